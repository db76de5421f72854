"""Print the shell commands of one section of a Markdown file: the lines of its first ```bash block.

``python .ci/readme_commands.py README.md "Set up"`` (``-`` for standard input) gives what a newcomer copies
from README's Set up, so that .ci/run runs those lines verbatim instead of a copy of them that could drift.
"""

import sys


def section_commands(text: str, heading: str) -> str:
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.lstrip("#").strip() == heading and line.startswith("#"))
    except StopIteration:
        raise SystemExit(f"no heading {heading!r} in the file") from None
    block, inside = [], False
    for line in lines[start + 1 :]:
        if not inside and line.startswith("#"):
            break  # the next section began before any code block
        if line.strip() == "```bash":
            inside = True
        elif inside and line.strip() == "```":
            return "\n".join(block) + "\n"
        elif inside:
            block.append(line)
    raise SystemExit(f"no ```bash block under the heading {heading!r}")


if __name__ == "__main__":
    path, heading = sys.argv[1], sys.argv[2]
    if path == "-":
        sys.stdout.write(section_commands(sys.stdin.read(), heading))
    else:
        with open(path, encoding="utf-8") as f:
            sys.stdout.write(section_commands(f.read(), heading))
