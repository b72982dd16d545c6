"""Reading the project's Markdown for the doc tests: sections, the command lines in code blocks, and
relative links with their anchors."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A path inside the repository, named in prose or code: it starts at one of the repository's own folders.
REPO_PATH = re.compile(r"(?<![\w./-])((?:scripts|configs|tests|docs|dapo_train|\.ci)/[\w./*<>-]*)")


def code_and_prose(text: str) -> tuple[list[str], list[str]]:
    """The lines of code blocks (fenced, or indented by 4 spaces after a blank line) and the others."""
    code, prose, fenced, previous_blank, indented = [], [], False, True, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        indented = line.startswith("    ") and (previous_blank or indented)
        (code if fenced or indented else prose).append(line)
        previous_blank = not line.strip()
    return code, prose


def section(text: str, heading: str) -> str:
    """The text under `## heading` up to the next heading of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    body = text.split(f"\n{heading}\n", 1)[1]
    stops = [body.find(f"\n{'#' * n} ") for n in range(1, len(level) + 1)]
    ends = [i for i in stops if i >= 0]
    return body[: min(ends)] if ends else body


def commands(text: str) -> list[list[str]]:
    """Every dapo-train invocation in the code blocks: the arguments after `dapo-train` (or after
    `-m dapo_train` under a launcher), one list per invocation; lines continued with a backslash are
    joined and `# comments` dropped."""
    code, _ = code_and_prose(text)
    joined = "\n".join(code).replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue  # Python in a code block (a string with an apostrophe), not a shell line
        segment: list[str] = []
        for token in [*tokens, "&&"]:
            if token != "&&":
                segment.append(token)
                continue
            if "dapo-train" in segment:
                found.append(segment[segment.index("dapo-train") + 1 :])
            elif "dapo_train" in segment and segment[segment.index("dapo_train") - 1] == "-m":
                found.append(segment[segment.index("dapo_train") + 1 :])
            segment = []
    return found


def is_synopsis(args: list[str]) -> bool:
    """A usage line (`[CONFIG] [KEY=VALUE ...]`), not a command to run."""
    return any(arg.startswith("[") or arg.endswith("...") or arg == "..." for arg in args)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    _, prose = code_and_prose(path.read_text(encoding="utf-8"))
    return {slug(line.lstrip("#")) for line in prose if re.match(r"#{1,6} ", line)}


def broken_links(path: Path) -> list[str]:
    """Relative links of a Markdown file (and their #anchors) that name no file or heading."""
    _, prose = code_and_prose(path.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall("\n".join(prose)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{path.name}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{path.name}: {target} (no such heading)")
    return broken


def missing_paths(path: Path, root: Path) -> list[str]:
    """Repository paths a file names (scripts/bench/bench_step.py, configs/ablation/*.yaml, in prose or
    code) that match nothing under `root`; a placeholder (scripts/<folder>/<name>.py) is not a path."""
    missing = []
    for named in REPO_PATH.findall(path.read_text(encoding="utf-8")):
        named = named.rstrip(".")
        if "<" in named or ">" in named:
            continue
        if not (any(root.glob(named)) if "*" in named else (root / named).exists()):
            missing.append(f"{path.relative_to(root)}: {named}")
    return missing
