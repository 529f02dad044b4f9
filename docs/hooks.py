"""MkDocs hooks. A method page's `<!-- semkv:parameters NAME -->` becomes the table of the method's parameters: the
default from `semkv.methods.SPECS` and the meaning from the method's docstring (`MethodSpec.parameter_docs`), so the
page and `semkv methods NAME` say what the code says. A command's page gets its options the same way from the parser
`semkv` runs (`<!-- semkv:options COMMAND -->`).

The results pages of `benchmarks/results/` (with the raw files and plots they link) are part of the site
under `results/`, read from where they are kept, so the repository holds one copy and `mkdocs build --strict` checks
their links too. A page's link to a folder (`2026-11-24-h200/`, which GitHub shows as a listing) becomes a link to a
listing page made for that folder."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's semkv, whatever is installed
from semkv.cli.main import build_parser  # noqa: E402  (builds every subcommand's parser without torch)
from semkv.methods.specs import SPECS  # noqa: E402  (plain data: no torch)

BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
FOLDER_LINK = re.compile(r"\]\(([^)#\s:]+/)\)")  # [text](some/folder/)
PARAMETERS = re.compile(r"<!-- semkv:parameters (\w+) -->")
OPTIONS = re.compile(r"<!-- semkv:options (\w+) -->")
RESULTS_LIST = "<!-- semkv:results -->"


def results_list() -> str:
    """One line per results page (benchmarks/results/*.md), newest first, with its title."""
    lines = []
    for page in sorted(RESULTS.glob("*.md"), reverse=True):
        title = next((line.lstrip("# ").strip() for line in page.read_text(encoding="utf-8").splitlines()
                      if line.startswith("# ")), page.stem)
        lines.append(f"- [{page.stem}]({page.name}): {title}")
    return "\n".join(lines)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def options_table(command: str) -> str:
    """The markdown table of a subcommand's arguments, as `semkv COMMAND --help` gives them."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    formatter = sub._get_formatter()
    rows = ["| argument | default | meaning |", "| --- | --- | --- |"]
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = " / ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
        if action.required or not action.option_strings:
            default = "required" if action.nargs is None or action.required else ""
        elif action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            default = ""
        else:
            default = f"`{action.default}`"
        meaning = formatter._expand_help(action) if action.help else ""
        rows.append(f"| {names} | {cell(default)} | {cell(meaning)} |")
    return "\n".join(rows)


def parameter_table(name: str) -> str:
    """The markdown table of a method's parameters, the budget first."""
    spec = SPECS[name]
    docs = spec.parameter_docs()
    rows = ["| parameter | default | meaning |", "| --- | --- | --- |"]
    for param, default in ({"budget": None} | spec.params).items():
        shown = "required" if param == "budget" else f"`{default!r}`"
        rows.append(f"| `{param}` | {cell(shown)} | {cell(docs.get(param, ''))} |")
    return "\n".join(rows)


def linked_folders() -> set[Path]:
    """Every folder under results/ that a results page links to."""
    found = set()
    for page in RESULTS.rglob("*.md"):
        for target in FOLDER_LINK.findall(page.read_text(encoding="utf-8")):
            folder = (page.parent / target).resolve()
            if folder.is_dir() and RESULTS in folder.parents:
                found.add(folder)
    return found


FOLDERS: set[Path] = set()  # the linked folders of this build


def listing(folder: Path) -> str:
    """A page listing a folder's files and sub-folders."""
    lines = [f"# {folder.relative_to(RESULTS).as_posix()}/", "", "The files of this folder of results.", ""]
    for path in sorted(folder.iterdir()):
        if path.is_file():
            lines.append(f"- [`{path.name}`]({path.name})")
        elif path in FOLDERS:
            lines.append(f"- [`{path.name}/`]({path.name}/index.md)")
        else:
            lines.append(f"- `{path.name}/`")
    return "\n".join(lines) + "\n"


def on_files(files: Files, config) -> Files:
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file():
            files.append(File(path.relative_to(BENCHMARKS).as_posix(), str(BENCHMARKS), config["site_dir"],
                              config["use_directory_urls"]))
    FOLDERS.clear()
    FOLDERS.update(linked_folders())
    for folder in sorted(FOLDERS):
        uri = f"{folder.relative_to(BENCHMARKS).as_posix()}/index.md"
        files.append(File.generated(config, uri, content=listing(folder)))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    markdown = PARAMETERS.sub(lambda m: parameter_table(m.group(1)), markdown)
    markdown = OPTIONS.sub(lambda m: options_table(m.group(1)), markdown).replace(RESULTS_LIST, results_list())
    source = page.file.abs_src_path
    if source is None or RESULTS not in Path(source).parents:
        return markdown
    base = Path(source).parent

    def to_listing(m: re.Match) -> str:
        folder = (base / m.group(1)).resolve()
        return f"]({m.group(1)}index.md)" if folder in FOLDERS else m.group(0)

    return FOLDER_LINK.sub(to_listing, markdown)
