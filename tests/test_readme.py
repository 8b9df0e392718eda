"""The README's example is the first thing a user runs: it must run as written."""
import pathlib
import re


def test_readme_example_runs():
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = next(b for b in blocks if "torch.ops.paged.decode_attention" in b)
    namespace = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["decode_out"].isfinite().all()


def test_readme_cascade_example_runs():
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    example = next(b for b in blocks if "merge_attention_states" in b)
    namespace = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["out"].isfinite().all()
