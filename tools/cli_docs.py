"""docs/cli.md, generated from the console scripts' argparse parsers: one section per command with its usage
line, description and a table of every option (flags, default, help).

    python -m clover.tools.cli_docs            rewrite docs/cli.md
    python -m clover.tools.cli_docs --check    exit 1 if docs/cli.md is not what the parsers say

The output depends on the parsers only (usage lines are wrapped at a fixed width, not the terminal's), and
building them imports neither torch nor onnxruntime: every tool imports those inside its `run`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from clover import atomic
from clover.errors import CloverError
from clover.tools.cli import run_cli

# pyproject.toml [project.scripts], in its order: command -> module with build_parser()
COMMANDS = (
    ("clover-generate", "clover.tools.generate"),
    ("clover-export", "clover.tools.export"),
    ("clover-train", "clover.tools.train"),
    ("clover-data", "clover.tools.data"),
    ("clover-bench", "clover.tools.bench"),
    ("clover-serve", "clover.tools.serve"),
    ("clover-compare", "clover.tools.compare"),
    ("clover-doctor", "clover.tools.doctor"),
)
DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
WIDTH = 100  # usage lines are wrapped here, whatever COLUMNS says
STALE = "docs/cli.md is stale: run python -m clover.tools.cli_docs"


def parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """Each console script's parser, by command name."""
    return [(name, importlib.import_module(module).build_parser()) for name, module in COMMANDS]


def render() -> str:
    """docs/cli.md's text."""
    out = [
        "# Command-line reference",
        "",
        "<!-- Generated from the argparse parsers by `python -m clover.tools.cli_docs`: do not edit by hand. -->",
        "",
        "Every console script that `pip install clover-deploy` puts on the PATH, as its `--help` describes it.",
        "",
    ]
    out += [f"- [`{name}`](#{name})" for name, _ in COMMANDS] + [""]
    for name, parser in parsers():
        out += section(name, parser, "##")
    return "\n".join(out).rstrip("\n") + "\n"


def section(name: str, parser: argparse.ArgumentParser, level: str) -> list[str]:
    fmt = formatter(parser)
    out = [f"{level} {name}", ""]
    if parser.description:
        out += [prose(parser.description, parser), ""]
    fmt.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    out += ["```text", fmt.format_help().strip("\n"), "```", ""]
    rows, commands = [], None
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands = action
        elif action.help is not argparse.SUPPRESS:
            rows.append(option_row(action, fmt))
    if rows:
        out += ["| Option | Default | Description |", "| --- | --- | --- |", *rows, ""]
    if parser.epilog:
        out += [prose(parser.epilog, parser), ""]
    if commands is not None:
        helps = {a.dest: a.help or "" for a in commands._choices_actions}
        out += ["| Command | Description |", "| --- | --- |"]
        out += [f"| [`{sub}`](#{anchor(f'{name} {sub}')}) | {cell(helps.get(sub, ''))} |" for sub in commands.choices]
        out.append("")
        for sub, subparser in commands.choices.items():
            out += section(f"{name} {sub}", subparser, level + "#")
    return out


def formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return parser.formatter_class(prog=parser.prog, width=WIDTH)


def option_row(action: argparse.Action, fmt: argparse.HelpFormatter) -> str:
    flags = fmt._format_action_invocation(action)
    help_text = fmt._expand_help(action) if action.help else ""
    return f"| `{code(flags)}` | {default(action)} | {cell(help_text)} |"


def default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    value = action.default
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "on" if value else "off"
    if value is None or value is argparse.SUPPRESS or value == []:
        return ""
    return f"`{code(str(value))}`"


def prose(text: str, parser: argparse.ArgumentParser) -> str:
    """A description or epilog: kept line by line under RawDescriptionHelpFormatter, else one paragraph."""
    text = text % {"prog": parser.prog} if "%(prog)" in text else text
    if issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter):
        return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())
    return " ".join(text.split())


def cell(text: str) -> str:
    """One table cell: whitespace collapsed, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def code(text: str) -> str:
    """Inside backticks in a table cell: only the pipe needs escaping."""
    return text.replace("|", "\\|")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading made of lowercase words, hyphens and spaces."""
    return heading.lower().replace(" ", "-")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m clover.tools.cli_docs", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only compare: exit 1 if docs/cli.md differs")
    return p


def run(args: argparse.Namespace) -> int:
    text = render()
    if args.check:
        current = DOC.read_text(encoding="utf-8") if DOC.is_file() else None
        if current != text:
            print(STALE, file=sys.stderr)
            return 1
        return 0
    if not DOC.parent.is_dir():
        raise CloverError(f"no docs/ folder at {DOC.parent}: run this from a source checkout")
    atomic.write_text(DOC, text)
    print(f"wrote {DOC}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli("cli_docs", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
