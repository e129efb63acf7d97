#!/usr/bin/env bash
# The native kernels on AArch64 (Arm: Graviton, Ampere, ...), from an x86-64 Debian 12 machine: an arm64 CPython
# 3.11 with PyTorch's aarch64 wheel under qemu's user-mode emulation (no binfmt_misc needed), building the kernels
# with the AArch64 cross compiler, then running their tests there.
#
#   bash benchmarks/performance/arm64_emulation.sh ROOT [PYTEST_ARGS...]
#
# ROOT: a folder for the arm64 userland (~4 GB: PyPI's aarch64 torch 2.13.0 is a CUDA build, whose NVIDIA
# libraries must be present for it to import, GPU or not).  Made once; a second call reuses it.  Needs root (apt)
# the first time.  Default PYTEST_ARGS: the kernel-level tests of tests/nn/test_native.py (the -k list of
# test_every_vector_width_computes_the_same).  Emulated, `import torch` takes ~25 s and the default tests a few
# minutes on 2 cores.  What it shows: the source builds with the Arm flags and the 4-lane NEON kernels compute
# what the float64 references and torch's paths compute.  Speed under emulation means nothing.
#
# Notes: qemu-user shows the host's /proc/cpuinfo, on which torch's cpuinfo crashes; with -L, qemu opens
# ROOT/proc/cpuinfo instead when it exists, so ROOT gets an aarch64 one (qemu's default "max" CPU).  The wrapper
# ROOT/usr/bin/python3 (an x86 shell script) makes sys.executable go through qemu too, so subprocesses work.
# A cross compiler has no host to ask for -mcpu=native: ROOT/cc (also a wrapper) builds for neoverse-n1 instead.
set -euo pipefail
root=${1:?usage: arm64_emulation.sh ROOT [PYTEST_ARGS...]}
shift
root=$(realpath -m "$root")
repo=$(cd "$(dirname "$0")/../.." && pwd)
py=3.11
if [ ! -x "$root/usr/bin/python3" ]; then
    command -v qemu-aarch64 >/dev/null && command -v aarch64-linux-gnu-gcc >/dev/null ||
        apt-get install -y -q qemu-user gcc-aarch64-linux-gnu
    mkdir -p "$root" "$root.dl/debs" "$root.dl/wheels"
    # CPython and the libraries it loads, from Debian's arm64 archive: downloaded and unpacked, never installed
    dpkg --add-architecture arm64
    trap 'dpkg --remove-architecture arm64 2>/dev/null; apt-get update -q >/dev/null 2>&1' EXIT  # also on failure
    apt-get update -q
    (cd "$root.dl/debs" && apt-get download \
        $(printf '%s:arm64 ' python$py-minimal libpython$py-minimal libpython$py-stdlib python$py libc6 \
          libgcc-s1 libstdc++6 libgomp1 libgfortran5 gcc-12-base zlib1g libbz2-1.0 liblzma5 libzstd1 libexpat1 \
          libffi8 libssl3 libncursesw6 libtinfo6 libreadline8 libuuid1 libcrypt1 libnsl2 libtirpc3 \
          libdb5.3 libgdbm6 libgdbm-compat4 libsqlite3-0 libgssapi-krb5-2 libkrb5-3 libk5crypto3 \
          libkrb5support0 libcom-err2 libkeyutils1) libtirpc-common media-types readline-common)
    dpkg --remove-architecture arm64 || true
    apt-get update -q >/dev/null || true
    trap - EXIT
    for d in "$root.dl/debs"/*.deb; do dpkg -x "$d" "$root"; done
    # torch's aarch64 wheel and what it needs (its NVIDIA libraries among them), numpy, pytest
    plat=()
    for n in 17 18 24 25 26 27 28; do plat+=(--platform "manylinux_2_${n}_aarch64"); done
    python3 -m pip download -q --only-binary=:all: --python-version $py --implementation cp "${plat[@]}" \
        --platform manylinux2014_aarch64 -d "$root.dl/wheels" torch==2.13.0 numpy pytest pytest-timeout safetensors
    mkdir -p "$root/opt/site"
    for w in "$root.dl/wheels"/*.whl; do python3 -m zipfile -e "$w" "$root/opt/site"; done
    # an aarch64 /proc/cpuinfo and CPU topology for torch's cpuinfo (see the notes above)
    mkdir -p "$root/proc"
    for c in 0 1; do
        features="fp asimd aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
        printf 'processor\t: %s\nBogoMIPS\t: 2000.00\nFeatures\t: %s\n' $c "$features"
        printf 'CPU implementer\t: 0x00\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0x051\nCPU revision\t: 0\n\n'
        d="$root/sys/devices/system/cpu/cpu$c"
        mkdir -p "$d/regs/identification" "$d/topology"
        echo 0x00000000000f0510 >"$d/regs/identification/midr_el1"
        echo 0x0000000000000000 >"$d/regs/identification/revidr_el1"
        for f in thread_siblings_list core_cpus_list core_id; do echo $c >"$d/topology/$f"; done
        for f in package_cpus_list core_siblings_list; do echo 0-1 >"$d/topology/$f"; done
        echo 0 >"$d/topology/physical_package_id"
    done >"$root/proc/cpuinfo"
    for f in online possible present; do echo 0-1 >"$root/sys/devices/system/cpu/$f"; done
    echo 255 >"$root/sys/devices/system/cpu/kernel_max"
    cat >"$root/cc" <<'EOF'
#!/bin/sh
# the AArch64 cross compiler for difftx's build: -mcpu=native (no host to ask) becomes a named core
for a in "$@"; do [ "$a" = "-mcpu=native" ] && a="-mcpu=neoverse-n1"; set -- "$@" "$a"; shift; done
exec aarch64-linux-gnu-gcc "$@"
EOF
    cat >"$root/usr/bin/python3" <<EOF
#!/bin/sh
# the arm64 CPython under qemu-user; sys.executable is this script, so subprocesses run under qemu too
export PYTHONPATH="$root/opt/site\${PYTHONPATH:+:\$PYTHONPATH}"
exec qemu-aarch64 -L "$root" -0 "$root/usr/bin/python3" "$root/usr/bin/python$py" "\$@"
EOF
    chmod +x "$root/cc" "$root/usr/bin/python3"
fi
cd "$repo"
[ $# -gt 0 ] || set -- tests/nn/test_native.py -k "softmax_combine_and_backward or rms_norm_native or \
native_equals_torch_path_fp32 or swiglu or rope or decode or native_float32_attention or few_rows or nan_payloads \
or build_where"
mkdir -p "$root/cache"
CC="$root/cc" DIFFTX_CACHE_DIR="$root/cache" PYTHONPATH="$repo/src" "$root/usr/bin/python3" -c \
    "import platform, torch; from difftx.nn import native
print(platform.machine(), 'torch', torch.__version__); print('kernels:', native.status())"
CC="$root/cc" DIFFTX_CACHE_DIR="$root/cache" PYTHONPATH="$repo/src" "$root/usr/bin/python3" -m pytest \
    -p no:cacheprovider -o addopts="" -m "not slow" --timeout 900 -q "$@"
