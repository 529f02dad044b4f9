"""The documentation: every method and every command has a page, the registry of methods (plain data, read without
torch) agrees with the method classes, every public name is in the API reference, the README stays short with working
links and set-up blocks, the results pages stay lean, and the site builds with `mkdocs build --strict` (no broken
link or anchor, no page missing from the navigation)."""
from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import semkv
import semkv.eval
import semkv.methods
from semkv.cli.main import COMMANDS
from semkv.methods import METHODS, SPECS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"


def nav_pages() -> set[str]:
    """Every page the site's navigation names."""
    found: set[str] = set()

    def walk(item) -> None:
        if isinstance(item, str):
            found.add(item)
        elif isinstance(item, list):
            for x in item:
                walk(x)
        elif isinstance(item, dict):
            for x in item.values():
                walk(x)

    config = (ROOT / "mkdocs.yml").read_text()
    walk(yaml.safe_load(config)["nav"])
    return found


def test_every_method_has_a_page_with_its_paper_and_parameters():
    nav = nav_pages()
    for name, spec in SPECS.items():
        page = DOCS / "methods" / f"{name}.md"
        assert page.is_file(), f"method {name!r} has no page docs/methods/{name}.md"
        assert f"methods/{name}.md" in nav, f"docs/methods/{name}.md is not in mkdocs.yml's nav"
        text = page.read_text()
        assert spec.paper in text, f"docs/methods/{name}.md does not cite {spec.paper}"
        if spec.params:
            assert f"<!-- semkv:parameters {name} -->" in text, f"docs/methods/{name}.md has no parameter table"
        for section in ("## Our implementation", "## Measured", "## Limits"):
            assert section in text, f"docs/methods/{name}.md has no {section!r} section"


def test_every_command_has_a_page_with_its_options():
    nav = nav_pages()
    for command in COMMANDS:
        page = DOCS / "cli" / f"{command}.md"
        assert page.is_file(), f"`semkv {command}` has no page docs/cli/{command}.md"
        assert f"cli/{command}.md" in nav, f"docs/cli/{command}.md is not in mkdocs.yml's nav"
        assert f"<!-- semkv:options {command} -->" in page.read_text(), f"docs/cli/{command}.md lists no options"


def test_the_registry_agrees_with_the_method_classes():
    """SPECS (plain data) says of each method what its class says: the same names in the same order, class, kind,
    summary, parameter defaults and paper; and the method's docstring explains every parameter."""
    assert list(SPECS) == list(METHODS)
    for name, cls in METHODS.items():
        spec = SPECS[name]
        assert spec.cls == f"{cls.__module__}:{cls.__name__}"
        assert (spec.kind, spec.summary) == (cls.kind, cls.summary), name
        assert spec.params == {k: v for k, v in cls.parameters().items() if k != "budget"}, name
        assert spec.paper in (inspect.getmodule(cls).__doc__ or ""), f"{name}'s docstring does not cite {spec.paper}"
        documented = spec.parameter_docs()
        wanted = set(spec.params) | ({"budget"} if spec.kind != "full" else set())
        assert {p for p in wanted if documented.get(p)} == wanted, f"{name}: parameters its docstring does not explain"


def test_semkv_methods_answers_without_torch():
    """The list and one method's parameters come from SPECS and the method's source, not from importing it."""
    code = ("import sys; from semkv.cli.main import main; main(['methods']); main(['methods', 'chess']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in out.stdout.splitlines()[: 2 * len(SPECS):2]] == list(SPECS)
    assert "entropy_threshold = None" in out.stdout


def public_names() -> list[tuple[str, object]]:
    return [(f"{module.__name__}.{name}", getattr(module, name))
            for module in (semkv, semkv.methods, semkv.eval) for name in module.__all__]


def test_every_public_name_is_in_the_api_reference():
    """Each public class or function is rendered by a `::: module.name` directive, or its whole module is; a dict
    (METHODS, SPECS) is named in the reference. Each has a docstring of its own or, for a method class, its module's
    (the paper and every parameter) and its methods page."""
    api = "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    directives = set(re.findall(r"^::: ([\w.]+)", api, re.M))
    for public, obj in public_names():
        if isinstance(obj, dict):
            assert public.rsplit(".", 1)[1] in api, f"{public} is not named in docs/api/"
            continue
        where = f"{obj.__module__}.{obj.__qualname__}"
        assert where in directives or obj.__module__ in directives, f"{public} ({where}) is not in docs/api/"
        own = obj.__doc__ and not obj.__doc__.startswith(f"{obj.__name__}(")  # not a dataclass's generated one
        module_doc = importlib.import_module(obj.__module__).__doc__
        assert own or (module_doc and obj in METHODS.values()), f"{public} has no docstring"


def test_the_readme_is_short_and_its_set_up_and_links_work():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for marker in ("<!-- setup-run -->", "<!-- setup-test -->"):
        after = text.split(marker, 1)[1].lstrip("\n")
        assert after.startswith("```bash\n"), f"no bash block right after {marker}"
    test_command = text.split("<!-- setup-test -->", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert '".[test,docs]"' in test_command and "pytest" in test_command
    for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", text):
        if not re.match(r"\w+://", target):
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_results_pages_keep_raw_rows_compressed_and_small():
    """Raw rows are .jsonl.gz; a results page's folder stays within a few MB; a plot or HTML view is kept only where a
    page links or names it."""
    assert sorted(RESULTS.rglob("*.jsonl")) == []
    for folder in (p for p in RESULTS.iterdir() if p.is_dir()):
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        assert size < 4e6, f"{folder.name} holds {size / 1e6:.1f} MB"
    text = "\n".join(p.read_text() for p in RESULTS.rglob("*.md"))
    linked = {(md.parent / t).resolve() for md in RESULTS.rglob("*.md")
              for t in re.findall(r"\]\(([^)#\s]+)", md.read_text())}
    for view in [*RESULTS.rglob("*.html"), *RESULTS.rglob("*.png")]:
        named = view.name != "decode.png" and view.name in text
        assert view.resolve() in linked or named, f"{view.relative_to(ROOT)} is linked by no page"


def test_the_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: any broken link or anchor, a page missing from the nav, a missing snippet or a
    mkdocstrings object that does not resolve fails the build."""
    for package in ("mkdocs", "material", "mkdocstrings"):
        pytest.importorskip(package, reason='the docs extra: pip install -e ".[docs]"')
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                         capture_output=True, text=True, timeout=1200,
                         env=os.environ | {"NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-4000:]
    snapkv = (site / "methods" / "snapkv" / "index.html").read_text()
    assert "kernel_size" in snapkv and "pooling kernel, 5" in snapkv  # the parameter table, from the docstring
    assert "--port" in (site / "cli" / "serve" / "index.html").read_text()  # the options, from the parser
    assert "2026-11-26-h100-suite" in (site / "results" / "index.html").read_text()
    assert (site / "results" / "2026-11-26-h100-suite" / "eval_qwen_31k" / "predictions.jsonl.gz").is_file()
