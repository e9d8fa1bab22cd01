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


def _block_commands(markdown: str) -> list:
    """Each command line of a page's shell code blocks: continuations joined, comments removed, and the shell
    variables a block sets (B="quant=16a4w_block ...") expanded where it uses them."""
    commands = []
    for lang, block in re.findall(r"^```([^\n]*)\n(.*?)^```", markdown, re.M | re.S):
        if lang.strip() not in ("bash", "sh", "shell", ""):
            continue
        variables = {}
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"(^|\s+)#.*$", "", line).strip()
            assigned = re.match(r"^([A-Z][A-Z0-9_]*)=(\"[^\"]*\"|'[^']*'|\S+)$", line)
            if assigned:
                value = assigned.group(2)
                variables[assigned.group(1)] = value[1:-1] if value[0] in "\"'" else value
            elif line and not line.startswith(("load ->", "export ", "for ", "done", "qexp:", "│", "└")):
                for name, value in variables.items():
                    line = re.sub(rf"\$\{{?{name}\}}?(?![A-Za-z0-9_])", lambda _: value, line)
                commands.append(line)
    return commands


def _manual_commands() -> list:
    """(page, command) for README.md and every page of docs/ but the research notes (dated records of what was run
    at their commit, kept as run)."""
    pages = [REPO / "README.md"] + sorted(p for p in DOCS.rglob("*.md") if "research" not in p.parts)
    return [(str(p.relative_to(REPO)), c) for p in pages for c in _block_commands(p.read_text(encoding="utf-8"))]


# the Hydra apps among qexp's modules: their config and what they imply (qexp.speed: the HTP backend)
HYDRA_APPS = {"qexp": ("config", []), "qexp.search": ("search", []), "qexp.sensitivity": ("sensitivity", []),
              "qexp.speed": ("config", ["backend=htp"])}
HYDRA_FLAGS = {"--cfg": 1, "-c": 1, "--package": 1, "-p": 1, "--info": 0, "--help": 0, "--multirun": 0, "-m": 0}


def _qexp_overrides(args: list) -> list:
    """The overrides of a `python -m qexp` command line, each sweep taken value by value (one at a time, the others
    at their first value): the override lists to compose."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    plain, i = [], 0
    while i < len(args):
        if args[i] in HYDRA_FLAGS:
            i += 1 + HYDRA_FLAGS[args[i]]
            continue
        plain.append(args[i])
        i += 1
    parsed = OverridesParser.create().parse_overrides(plain)
    values = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
              else [o.input_line] for o in parsed]
    first = [v[0] for v in values]
    return [first] + [first[:k] + [v] + first[k + 1:] for k, vs in enumerate(values) for v in vs[1:]]


def _check_command(command: str, helps: dict) -> bool:
    """Raise if a manual's command does not work as written; False for a command qexp does not own (git, curl)."""
    import shlex

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import qexp.backends  # noqa: F401 - the config schemas

    if re.match(r"^\S+/\s", command):  # a folder tree's line, not a command
        return False
    words = shlex.split(command)
    words = words[next((i for i, w in enumerate(words) if not re.match(r"^[A-Z][A-Z0-9_]*=", w)), len(words)):]
    if not words:
        return False
    if words[0] == "make":
        assert re.search(rf"^{re.escape(words[1])}:", (REPO / "Makefile").read_text(), re.M), "no such make target"
    elif words[0] == "bash" or words[0].startswith(("scripts/", "benchmarks/", "diagnostics/")):
        script = words[1] if words[0] == "bash" else words[0]
        assert (REPO / script).is_file(), f"no {script}"
    elif words[0].endswith(("python", "python3")) and words[1:2] == ["-m"] and words[2].split(".")[0] == "qexp":
        module, args = words[2], words[3:]
        if module in HYDRA_APPS:
            config, base = HYDRA_APPS[module]
            for overrides in _qexp_overrides([a for a in args if a != "--all-socs"]):
                GlobalHydra.instance().clear()
                with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
                    hydra_compose(config, overrides=base + overrides, return_hydra_config=True)
            GlobalHydra.instance().clear()
            return True
        # the subcommands named (up to two: `qexp.tasks lm_eval run`), each listed in its parent's help, and the
        # flags in the help of the deepest one that has its own
        words = [module]
        for word in args[:2]:
            choices = re.search(r"\{([\w,-]+)\} \.\.\.", _help(words, helps))  # usage: ... {a,b} ...
            if not choices or not re.match(r"^[a-z][a-z_-]*$", word):  # no subcommands here: a positional value
                break
            assert word in choices.group(1).split(","), f"{' '.join(words)} has no subcommand {word}"
            words.append(word)
            if not _help(words, helps):  # lm-eval's own command line: its flags are lm-eval's, not checked here
                return True
        named = [a.split("=")[0] for a in args if a.startswith("--")]
        missing = [a for a in named if a not in _help(words, helps)]
        assert not missing, f"{' '.join(words)} has no {missing}"
    else:
        return False
    return True


def _help(words: list, helps: dict) -> str:
    """`python -m <words> --help` (cached); empty where that command has no help of its own."""
    key = " ".join(words)
    if key not in helps:
        proc = subprocess.run([sys.executable, "-m", *words, "--help"], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        helps[key] = proc.stdout if proc.returncode == 0 and "usage: python -m qexp" in proc.stdout else ""
        assert helps[key] or len(words) > 1, f"{key} --help failed: {proc.stderr[-500:]}"
    return helps[key]


def test_every_command_in_the_manual_parses():
    """The commands of the README and of every docs/ page work as written: each `make` target exists, each script
    path exists, each `python -m qexp` command's overrides (every value of a sweep, Hydra's own settings included)
    compose with Hydra, and each other qexp module's flags and subcommands are in its --help."""
    helps, failures, checked = {}, [], 0
    for page, command in _manual_commands():
        try:
            checked += _check_command(command, helps)
        except Exception as exc:  # noqa: BLE001 - every broken command is listed, not the first only
            failures.append(f"{page}: {command}\n    {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    assert not failures, f"{len(failures)} command(s) of the manual do not work as written:\n" + "\n".join(failures)
    assert checked > 100, checked  # the pages' commands were found


@pytest.mark.parametrize("command", [
    "python -m qexp eval.limt=4",  # a key that does not exist
    "python -m qexp -m quant=16a8w,16a5w",  # a sweep value that does not
    "python -m qexp eval.task_paths=[~/my_tasks]",  # Hydra cannot lex it unquoted
    "python -m qexp hydra/launcher=slurmm",
    "python -m qexp.report --experimnt x",
    "make tests",
])
def test_the_manual_check_finds_a_broken_command(command):
    with pytest.raises(Exception):
        _check_command(command, {})


def test_manual_commands_expand_a_blocks_variables():
    page = "```bash\nB=\"quant=16a4w eval.limit=4\"\npython -m qexp -m $B text=news  # a comment\n```\n"
    assert _block_commands(page) == ["python -m qexp -m quant=16a4w eval.limit=4 text=news"]
