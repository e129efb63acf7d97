"""The package's namespace: a plain ``import difftx`` reaches its subpackages as attributes, imported on first use."""

import subprocess
import sys


def test_subpackages_are_attributes_after_a_plain_import():
    code = (
        "import sys, difftx\n"
        "assert 'difftx.evals' not in sys.modules and 'transformers' not in sys.modules\n"
        "assert callable(difftx.data.load_tokenizer) and difftx.evals.__name__ == 'difftx.evals'\n"
        "assert difftx.optim.__name__ == 'difftx.optim' and difftx.train.__name__ == 'difftx.train'\n"
        "try:\n"
        "    difftx.no_such_thing\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_thing' in str(e)\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
