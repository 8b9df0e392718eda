"""The README's example is the first thing a user runs: it must run as written."""
import pathlib
import re


def run_python_block(containing: str) -> dict:
    """Runs the README's first python block that contains the text; returns its variables."""
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = next(b for b in blocks if containing in b)
    namespace = {}
    exec(compile(example, "README.md", "exec"), namespace)
    return namespace


def test_readme_example_runs():
    assert run_python_block("torch.ops.paged.decode_attention")["decode_out"].isfinite().all()


def test_readme_cascade_example_runs():
    assert run_python_block("merge_attention_states")["out"].isfinite().all()


def test_readme_benchmark_command_runs(tmp_path):
    """The README's bench.paged_attention command, as pasted (one timed round and a small copy peak
    added, so it costs seconds), writing its results and plot outside the tree."""
    import os
    import shlex
    import subprocess
    import sys

    root = pathlib.Path(__file__).parent.parent
    blocks = re.findall(r"```bash\n(.*?)```", (root / "README.md").read_text(), re.S)
    [command] = [b for b in blocks if "-m bench.paged_attention" in b]
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:3] == [".venv/bin/python", "-m", "bench.paged_attention"], argv
    env = os.environ | {"PAGED_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run([sys.executable, *argv[1:], "--warmup", "0", "--iters", "1", "--peak-copy-mib", "64"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "load average" in proc.stdout and " ok" in proc.stdout
    assert list(tmp_path.glob("*.json")) and list(tmp_path.glob("*.png"))


def test_readme_mla_example_runs():
    """The absorbed MLA decode block, as written, against the float64 reference on the same inputs."""
    import torch
    from paged_ops import reference
    from paged_ops.testing import assert_close

    ns = run_python_block("concat_and_cache_mla")
    want = torch.empty(ns["mla_out"].shape, dtype=torch.float64)
    cache = ns["latent_cache"]
    reference.decode_attention(want, ns["query"].double(), cache, cache[..., :ns["kv_lora_rank"]],
                               ns["block_tables"], ns["seq_lens"], 192 ** -0.5)
    assert_close(ns["mla_out"], want, torch.bfloat16)
