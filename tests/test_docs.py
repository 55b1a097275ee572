"""The docs stay true: the README's size and test command, and an API reference entry per public name."""

import pathlib
import re

import hybrid_cp
import topology

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_is_short():
    # the README is the pitch, an example, the two quick-start commands and links; the rest lives in docs/
    assert len((ROOT / "README.md").read_bytes()) < 8 * 1024


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("python3 -m venv") and "pytest" in line)
    ci = (ROOT / ".ci" / "run").read_text()
    for step in command.split(" && "):
        step = step.replace("pip install ", "pip install -q ")  # CI installs quietly
        if not step.startswith(". .venv"):
            assert step in ci, f"the README's test step {step!r} is not in .ci/run"


def test_api_reference_has_every_public_name():
    documented = set(re.findall(r"^::: [\w.]*?(\w+)$", (ROOT / "docs" / "api.md").read_text(), flags=re.M))
    missing = sorted((set(hybrid_cp.__all__) | set(topology.__all__)) - documented)
    assert not missing, f"add these public names to docs/api.md: {missing}"


def test_models_page_has_the_generator_markers():
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("model_families", ROOT / "benchmarks" / "model_families.py")
    families = module_from_spec(spec)
    spec.loader.exec_module(families)
    page = (ROOT / "docs" / "models.md").read_text()
    assert all(page.count(marker) == 1 for marker in families.MARKERS)


def test_public_functions_say_what_their_arguments_are():
    """Google-style sections on every public function of `hybrid_cp` (the API reference renders them;
    `mkdocs build --strict` checks that they match the signatures)."""
    import inspect

    bare = [
        name
        for name in hybrid_cp.__all__
        if inspect.isfunction(obj := getattr(hybrid_cp, name))
        and inspect.signature(obj).parameters
        and "Args:" not in (inspect.getdoc(obj) or "")
    ]
    assert not bare, f"add an Args: section to the docstrings of {bare}"


def test_readme_links_exist():
    readme = (ROOT / "README.md").read_text()
    links = [link for link in re.findall(r"\]\(([^)#]+)", readme) if "://" not in link]
    assert links and all((ROOT / link).exists() for link in links), [x for x in links if not (ROOT / x).exists()]
