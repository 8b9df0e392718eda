"""Run the extension's build (a ``pip install -v ...`` command) and print one line per stage.

    python tools/build_progress.py build/build.log -- python -m pip install -v --no-build-isolation -e .

``pip -q`` is silent for the minutes the build takes and ``pip -v`` prints every compiler
command. This keeps the full output in the log file and prints, with the time since the start,
scikit-build-core's stages (``*** Configuring CMake...``), this project's CMake summary lines
(``paged_ops: ...``) and ninja's steps (``[12/57] csrc/cuda/decode.cu``). On failure it prints the
log's last lines and exits with pip's status.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

# ninja: "[12/57] Building CXX object CMakeFiles/paged_cpu_avx2.dir/csrc/cpu/kernels/attention.cpp.o"
_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\] (?:Building \S+ object \S*?CMakeFiles/(\S+?)\.dir/(csrc/\S+?)\.o\b"
                         r"|Linking .* (\S+)$)")
_STAGE = re.compile(r"^(\*\*\* .*|-- paged_ops: .*|Successfully installed .*)$")


def progress_line(line: str) -> str | None:
    """The progress line a build output line becomes, or None when it is not one."""
    line = line.strip()  # pip indents the backend's output
    step = _NINJA_STEP.match(line)
    if step:
        done, total, target, source, linked = step.groups()
        if linked:
            return f"[{done}/{total}] link {Path(linked).name}"
        # the cpu kernels are compiled once per ISA, each build its own target
        return f"[{done}/{total}] {source}" + ("" if target == "_C" else f" ({target})")
    stage = _STAGE.match(line)
    return stage.group(1).strip() if stage else None


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit(__doc__)
    log_path, command = Path(argv[0]), argv[2:]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start, tail = time.monotonic(), deque(maxlen=60)
    print(f"building paged_ops (full output: {log_path})", flush=True)
    with open(log_path, "w") as log, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                    text=True, errors="replace") as proc:
        for line in proc.stdout:
            log.write(line)
            tail.append(line)
            shown = progress_line(line)
            if shown:
                print(f"  {time.monotonic() - start:6.0f} s  {shown}", flush=True)
    if proc.returncode:
        sys.stderr.write("".join(tail))
        print(f"build failed (exit {proc.returncode}); full output: {log_path}", file=sys.stderr)
        return proc.returncode
    print(f"built in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
