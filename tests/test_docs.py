"""The documentation: README.md is a short front door and docs/ is the manual. The manual builds as a site with no
broken link or anchor (mkdocs --strict), and it names everything a user can select or run, so a new config file,
config group, benchmark or diagnostic script or module without documentation fails here (the drift test). No qexp
issue number and no path outside the repository in what users read."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from helpers import CONF, REPO

DOCS = REPO / "docs"
README_MAX_LINES = 200


def _docs_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.rglob("*.md")))


def _code_text(markdown: str) -> str:
    """Everything in fenced code blocks and inline code spans: where config names, commands and paths are written."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, re.M | re.S)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", markdown, flags=re.M | re.S)
    inline = re.findall(r"`([^`\n]+)`", rest)
    indented = re.findall(r"^(?: {4}|\t)(.+)$", rest, re.M)
    return "\n".join(fenced + inline + indented)


def _named(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def test_mkdocs_builds_strictly(tmp_path):
    """`mkdocs build --strict`: every page in the nav exists, every link between pages and every anchor resolves."""
    missing = [m for m in ("mkdocs", "material") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (pip install mkdocs mkdocs-material): the docs site "
                    f"cannot be built here")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"


def test_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move "
                                            f"reference to docs/ and findings to docs/research/")
    text = "\n".join(lines)
    for command in ("make run", "make test"):
        assert command in text


def _config_groups(folder):
    """The config groups under folder, nested ones too (sweeps/q4_0_gap/ is the group sweep/q4_0_gap)."""
    for group in sorted(p for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__"):
        yield group
        yield from _config_groups(group)


def test_every_config_group_and_file_is_documented():
    """Each conf/ group (nested ones too, e.g. sweep/q4_0_gap) and each of its YAML files (e.g. quant/16a4w_block) is
    named in code in docs/."""
    code = _code_text(_docs_text())
    undocumented = []
    for group in _config_groups(CONF):  # conf/sweep is a link to sweeps/
        name = group.relative_to(CONF).as_posix()
        if not _named(group.name, code):
            undocumented.append(f"{name}/")
        for yaml in sorted(group.glob("*.yaml")):
            if not _named(yaml.stem, code):
                undocumented.append(f"{name}/{yaml.stem}")
    assert not undocumented, f"config groups / files not named in docs/: {undocumented}"


def test_every_benchmark_script_is_documented():
    """Each script in benchmarks/ (timing and comparison) and diagnostics/ (research probes) is named in docs/."""
    text = _docs_text()
    scripts = sorted(f"{folder}/{p.name}" for folder in ("benchmarks", "diagnostics")
                     for p in (REPO / folder).iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py")
    assert any(s.startswith("diagnostics/") for s in scripts), "no diagnostics/ scripts found"
    undocumented = [s for s in scripts if not _named(s.split("/", 1)[1], text)]
    assert not undocumented, f"benchmark / diagnostic scripts not named in docs/: {undocumented}"


def test_every_module_is_listed_in_the_architecture():
    listed = set(re.findall(r"^\| `(qexp/[^`]+\.py)` \|", (DOCS / "architecture.md").read_text(encoding="utf-8"),
                            re.M))
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "qexp").rglob("*.py")}
    assert not modules - listed, f"modules missing from docs/architecture.md's list: {sorted(modules - listed)}"
    assert not listed - modules, f"docs/architecture.md lists modules that do not exist: {sorted(listed - modules)}"


def test_every_registered_backend_algorithm_and_family_is_documented():
    """What the registries hold (a new @register_* without docs fails here): each backend, algorithm (transforms and
    calibration algorithms) and model family by name in code in docs/, each family also by its HF architecture."""
    import qexp.backends  # noqa: F401 - registers the backends
    import qexp.models  # noqa: F401 - registers the families
    import qexp.transforms  # noqa: F401 - registers the algorithms
    from qexp.backends.registry import BACKENDS
    from qexp.models.families import FAMILIES, FEATURES
    from qexp.transforms.base import TRANSFORMS

    def shipped(registry):  # what the package registers; test files register their own (another worker's import)
        return [n for n, obj in registry.items() if getattr(obj, "__module__", "qexp").startswith("qexp")]

    code = _code_text(_docs_text())
    names = [f"backend {n}" for n in shipped(BACKENDS)] + [f"algorithm {n}" for n in shipped(TRANSFORMS)]
    names += [f"family {n}" for n in FAMILIES]
    names += [f"architecture {a}" for family in FAMILIES.values() for a in family.hf_architectures]
    names += [f"feature {n}" for n in FEATURES]
    undocumented = [n for n in names if not _named(n.split(" ", 1)[1], code)]
    assert not undocumented, f"registered but not named in code in docs/: {undocumented}"


def test_contributing_names_paths_that_exist():
    """CONTRIBUTING.md's checklists point at files and folders that exist (placeholders like <name> aside)."""
    text = (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
    paths = {m for m in re.findall(r"`([\w./-]+/[\w./-]*)`", text) if "<" not in m and not m.startswith(".venv")}
    assert paths, "no paths found in CONTRIBUTING.md"
    missing = sorted(p for p in paths if not (REPO / p.split("#")[0]).exists())
    assert not missing, f"CONTRIBUTING.md names paths that do not exist: {missing}"


ISSUE_REFERENCE = re.compile(r"#1[0-9]\b|\bissues? #\d+", re.I)


def test_no_issue_numbers_or_outside_paths():
    """What users read names no qexp issue number and no path outside the repository."""
    files = [REPO / "README.md", REPO / "results" / "README.md", REPO / "CHANGELOG.md", REPO / "CONTRIBUTING.md"]
    files += sorted(DOCS.rglob("*.md"))
    files += sorted(p for folder in (CONF, REPO / "sweeps") for p in folder.rglob("*") if p.is_file())  # conf/sweep
    # is a link to sweeps/, which rglob does not follow
    found = []
    for path in files:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "../shared" in line or ISSUE_REFERENCE.search(line):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, "issue numbers or outside paths:\n" + "\n".join(found)


def _readme_commands() -> list:
    """Each command line of the README's code blocks, its trailing comment removed."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    lines = "\n".join(re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)).splitlines()
    return [re.sub(r"\s+#.*$", "", line).strip() for line in lines if line.strip() and not line.startswith("load ->")]


def test_every_readme_command_parses(compose):
    """The README's commands work as written: each `make` target exists, each `python -m qexp` command's overrides
    compose with Hydra, and each other module's flags are in its --help."""
    import shlex

    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    helps = {}
    for command in _readme_commands():
        words = shlex.split(command)
        if words[0] == "make":
            assert re.search(rf"^{re.escape(words[1])}:", makefile, re.M), f"no make target for: {command}"
            continue
        assert words[:2] == [".venv/bin/python", "-m"], f"a README command qexp cannot check: {command}"
        module, args = words[2], words[3:]
        if module == "qexp":
            compose(args, tracked=False)  # raises on an unknown group, option or key
            continue
        if module not in helps:
            proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 0, f"{module} --help failed: {proc.stderr[-2000:]}"
            helps[module] = proc.stdout
        for flag in (a for a in args if a.startswith("--")):
            assert flag in helps[module], f"{module} has no {flag} (README: {command})"
