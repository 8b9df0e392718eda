"""When the vLLM plugin replaces vLLM's backend (#25 item 2), and the README's command as written.

vLLM 0.32 calls every installed ``vllm.general_plugins`` entry point when ``VLLM_PLUGINS`` is
unset, so paged_ops' register() decides itself: PAGED_OPS_VLLM=1 on, PAGED_OPS_VLLM=0 off (even
with VLLM_PLUGINS=paged_ops), unset: on when VLLM_PLUGINS names paged_ops. The whole-model runs
with VLLM_PLUGINS unset / =paged_ops / PAGED_OPS_VLLM=1 are in test_vllm_plugin.py.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests_vllm.make_models import make, make_tokenizer

pytest.importorskip("vllm", reason="make test-vllm runs these in the venv that has vLLM")

from paged_ops.integrations.vllm import selected  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "build", "vllm-models")
OURS = "paged_ops.integrations.vllm.PagedOpsAttentionBackend"
THEIRS = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


@pytest.mark.parametrize("environ, on", [
    ({}, False),                                                    # installed, not asked for
    ({"VLLM_PLUGINS": "paged_ops"}, True),
    ({"VLLM_PLUGINS": "lora_filesystem_resolver,paged_ops"}, True),
    ({"VLLM_PLUGINS": "none"}, False),                              # vLLM would not call it anyway
    ({"VLLM_PLUGINS": ""}, False),
    ({"PAGED_OPS_VLLM": "1"}, True),
    ({"PAGED_OPS_VLLM": "1", "VLLM_PLUGINS": "paged_ops"}, True),
    ({"PAGED_OPS_VLLM": "0"}, False),
    ({"PAGED_OPS_VLLM": "0", "VLLM_PLUGINS": "paged_ops"}, False),  # the opt-out wins
    ({"PAGED_OPS_VLLM": "", "VLLM_PLUGINS": "paged_ops"}, True),    # empty is unset
    ({"PAGED_OPS_VLLM": "true"}, True),
    ({"PAGED_OPS_VLLM": "off", "VLLM_PLUGINS": "paged_ops"}, False),
])
def test_selected(environ, on):
    assert selected(environ)[0] is on


def test_selected_refuses_other_values():
    with pytest.raises(ValueError, match="PAGED_OPS_VLLM='2'"):
        selected({"PAGED_OPS_VLLM": "2", "VLLM_PLUGINS": "paged_ops"})


@pytest.mark.parametrize("environ, path", [
    ({"PAGED_OPS_VLLM": "0", "VLLM_PLUGINS": "paged_ops"}, THEIRS),
    ({"PAGED_OPS_VLLM": "1"}, OURS),
    ({}, THEIRS),
])
def test_register_follows_selected(environ, path):
    # register() in a fresh process, as vLLM calls it; twice, as vLLM may.
    code = ("from paged_ops.integrations.vllm import register; register(); register()\n"
            "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
            "print('PATH', E.CPU_ATTN.get_path())")
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PAGED_OPS_VLLM")} | environ
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"PATH {path}" in proc.stdout.splitlines()


def readme_command() -> str:
    """The bash block of README.md's "Run vLLM with the plugin" section that runs vLLM's LLM."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("## Run vLLM with the plugin", 1)
    assert len(section) == 2, "README.md has no section 'Run vLLM with the plugin'"
    section = section[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "LLM(" in b]
    assert len(blocks) == 1, f"README.md's vLLM section should have one bash block running LLM(...), has {len(blocks)}"
    return blocks[0]


def test_readme_command_runs(tmp_path):
    """The README's command, as written there, with its model path pointing at a tiny Llama (with a
    tokenizer) and `python` at this venv's: it exits 0 and vLLM's log names the plugin once (the
    worker process; vLLM's default engine-core process and multiprocess executor, as a user gets)."""
    command = readme_command()
    # Never run an install line here (it would install into whatever pip is on PATH).
    assert not re.search(r"\bpip\b|\binstall\b", command), \
        f"README.md: the block that runs LLM(...) should hold only that command, installs in a block of their own:\n{command}"
    assert "path/to/model" in command and re.search(r"^\S+=\S+ python ", command, re.M), command
    model = make_tokenizer(make("llama", os.path.join(MODEL_DIR, "llama")))
    command = command.replace("path/to/model", model)
    command = re.sub(r"^((?:\S+=\S+ )*)python ", lambda m: m.group(1) + shlex.quote(sys.executable) + " ",
                     command, flags=re.M)
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PAGED_OPS_VLLM", "PYTHONPATH")}
    env |= dict(HF_HUB_OFFLINE="1")
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if "paged_ops:" in ln]
    assert len(lines) == 1 and f"paged_ops: CPU_ATTN -> {OURS}" in lines[0], lines
