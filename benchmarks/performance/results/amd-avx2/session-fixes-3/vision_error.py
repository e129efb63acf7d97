"""vit-tiny / vdnt-tiny logits against float64, in fp32 and under bf16 autocast (relative L2 over 256 images).

    PYTHONPATH=OLD/src python vision_error.py; PYTHONPATH=NEW/src python vision_error.py
"""
import json, torch, difftx
torch.set_num_threads(1)
out = {}
for preset in ("vit-tiny", "vdnt-tiny"):
    torch.manual_seed(0)
    m = difftx.build_model(difftx.ModelConfig.from_preset(preset)).eval()
    x = torch.randn(256, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m.double()(x.double()).logits
        m.float()
        f32 = m(x).logits.double()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b = m(x).logits.double()
    rel = lambda a: float((a - ref).norm() / ref.norm())
    out[preset] = {"fp32": f"{rel(f32):.2e}", "bf16_autocast": f"{rel(b):.2e}"}
print(json.dumps(out))
