"""The runtime imports and serves with eagle3_build, transformers and compilers made unimportable."""
import json
import subprocess
import sys

BLOCKER = """
import sys
class Block:
    BLOCKED = ("eagle3_build", "transformers", "torch_neuronx", "neuronx_cc", "gguf", "accelerate", "typer")
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None
sys.meta_path.insert(0, Block())
import eagle3_runtime.server  # the HTTP server imports too (FastAPI, uvicorn, jinja2, prometheus_client)
from eagle3_runtime.cli import main
sys.argv[0] = "eagle3-run"
rc = main()
assert not any(m.split(".")[0] in Block.BLOCKED for m in sys.modules), sorted(sys.modules)
sys.exit(rc)
"""


def test_runtime_runs_without_builder_or_transformers(tiny_bundles):
    _, bundle_dir = tiny_bundles.get("speculators", 3)
    r = subprocess.run([sys.executable, "-c", BLOCKER, str(bundle_dir), "--prompt", "Hello there",
                        "--max-tokens", "8", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 8
