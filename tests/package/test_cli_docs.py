"""The CLI as documented: every command has help that states defaults and meanings (no benchmark
figures), the README is a front page, every example in the README and the manual names real
commands and options, and the CLI's defaults are the library's."""


import click
from click.testing import CliRunner

from sparsecache.cli.main import cli
from support import REPO

README = (REPO / "README.md").read_text()


def command_paths(group: click.Group, prefix: str = "sparsecache"):
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from command_paths(cmd, f"{prefix} {name}")
        else:
            yield f"{prefix} {name}"


def test_every_command_is_documented_and_has_help():
    paths = list(command_paths(cli))
    assert len(paths) >= 3
    for path in paths:
        assert path in README, f"README does not mention `{path}`"
        r = CliRunner().invoke(cli, path.split()[1:] + ["--help"])
        assert r.exit_code == 0 and "Usage" in r.output


def test_help_states_defaults_and_meanings_not_benchmark_figures():
    """#96: a figure in `--help` goes stale with the next run, and a user cannot tell on which machine it
    was true. The product's commands say what an option does and its default; measured speed-ups, times
    and machines live in BENCHMARKS.md and the manual (`bench` commands describe measurements, and may)."""
    import re

    figure = re.compile(r"\d+(\.\d+)?\s?(x|×)(?![a-z])|\d+(\.\d+)?\s?(ms|min|minutes|GB/s|tokens/s)\b|\btook\b|"
                        r"EPYC|Xeon|H100|H200|\d{4}-\d{2}-\d{2}")
    found = []
    for path in command_paths(cli):
        if path.startswith("sparsecache bench"):
            continue
        r = CliRunner().invoke(cli, path.split()[1:] + ["--help"], terminal_width=10_000)
        found += [f"{path}: {line.strip()}" for line in r.output.splitlines() if figure.search(line)]
    assert found == []


def test_the_readme_is_a_front_page_not_the_manual():
    """README.md stays short (#54: what it is, the two commands, the headline table, a tour,
    links into the manual); the manual lives in docs/."""
    assert len(README.splitlines()) <= 250
    assert README.startswith("# sparsecache") and "bash scripts/setup.sh test && python3 -m pytest -q -n 2 --dist loadfile" in README


def _example_lines():
    """(file, line) of every `sparsecache …` command in a code block of README.md and docs/."""
    import re

    root = REPO
    for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        in_block = False
        for line in path.read_text().replace("\\\n", " ").splitlines():  # continued lines joined
            if line.startswith("```"):
                in_block = not in_block
            elif in_block and re.match(r"\s*sparsecache [a-z]", line):
                yield path.relative_to(root), line.split(" #")[0].split(" && ")[0].split(" | ")[0].strip()


def test_every_example_in_the_readme_and_the_manual_names_real_commands_and_options():
    """An example naming a command or an option that does not exist (renamed, removed) fails
    here; each one's arguments are not run (most need a store, a model or minutes)."""
    import shlex

    checked = 0
    for path, line in _example_lines():
        words = shlex.split(line.replace("…", "").replace("...", ""))[1:]
        cmd, i = cli, 0
        while isinstance(cmd, click.Group) and i < len(words) and words[i] in cmd.commands:
            cmd, i = cmd.commands[words[i]], i + 1
        assert not isinstance(cmd, click.Group), f"{path}: `{line}` names no command"
        opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        for w in words[i:]:
            if w.startswith("--"):
                assert w.split("=")[0] in opts, f"{path}: `{line}`: {cmd.name} has no option {w}"
        checked += 1
    assert checked >= 40


def test_the_cli_offers_every_coefficient_format_the_store_writes_and_no_other():
    # the choices come from a torch-free module so that `--help` does not import torch; this keeps them honest
    from sparsecache.codec.coding import COEF_DTYPES

    params = {p.name: p for cmd in (cli.commands["eval-dict"], cli.commands["encode-corpus"]) for p in cmd.params}
    for name in ("coef", "coef_dtype"):
        assert sorted(params[name].type.choices) == sorted(COEF_DTYPES)


def test_learn_dict_offers_every_atoms_dtype_a_dictionary_file_may_hold_and_no_other():
    from sparsecache.codec.dictionary import ATOM_DTYPES

    params = {p.name: p for p in cli.commands["learn-dict"].params}
    assert sorted(params["atoms_dtype"].type.choices) == sorted(ATOM_DTYPES)


def test_bench_omp_refuses_a_reference_of_no_signals():
    r = CliRunner().invoke(cli, ["bench", "omp", "--sklearn-n", "0"])
    assert r.exit_code == 2 and "--sklearn-n" in r.output


def test_a_fidelity_run_of_no_passages_is_refused_before_any_work():
    for args in (["eval-dict", "dictionaries/smollm2-135m-n8192-s80-L10"], ["bench", "quality"]):
        r = CliRunner().invoke(cli, [*args, "--passages", "0"])
        assert r.exit_code == 2 and "--passages" in r.output, r.output


def test_cli_defaults_are_the_librarys():
    """Where a default is a library function's parameter (not a config dataclass field, which
    the CLI reads directly), the CLI states the same value: a notebook and the CLI agree."""
    import inspect

    from sparsecache.ingest.config import EncodeOptions
    from sparsecache.ingest.encoder import encode_with
    from sparsecache.kvstore import compact

    def default(cmd, name):
        return next(p.default for p in cli.commands[cmd].params if p.name == name)

    # encode_with takes the CLI's own EncodeOptions (#96): one place for the encode's defaults
    assert inspect.signature(encode_with).parameters["options"].default == EncodeOptions()
    for name in ("batch_tokens", "keep", "index_kind", "adapt_steps", "workers"):
        assert default("encode-corpus", name) == getattr(EncodeOptions, name), name
    assert default("compact", "keep") == inspect.signature(compact).parameters["keep"].default
    assert default("compact", "index_kind") == inspect.signature(compact).parameters["index_kind"].default
    # the store's fixed settings are StoreConfig's (the CLI passes None); its help states them
    from sparsecache.store import StoreConfig

    said = " ".join(next(p.help for p in cli.commands["encode-corpus"].params if p.name == "encode_after").split())
    assert f"for a new store, {StoreConfig().encode_after}]" in said
    said = next(p.help for p in cli.commands["encode-corpus"].params if p.name == "chunk_tokens")
    assert f"[default: {StoreConfig().chunk_tokens}]" in said


def test_every_test_file_is_in_the_manuals_table_under_its_folder_and_named_once():
    """docs/reference/tests.md lists each test file in its folder's row, and no two files share a
    name (the tests import each other's fixtures by module name, and the table names files alone)."""
    import re

    rows = {m[1]: set(re.findall(r"`(test_\w+)`", m[2]))
            for m in re.finditer(r"^\| `tests/(\w+)/` \| [^|]+ \| ([^\n]+) \|$", (REPO / "docs/reference/tests.md").read_text(), re.M)}
    files = sorted((REPO / "tests").glob("*/test_*.py"))
    assert {f.parent.name: 0 for f in files}.keys() == rows.keys()
    assert {(f.parent.name, f.stem) for f in files} == {(d, n) for d, names in rows.items() for n in names}
    assert len({f.name for f in files}) == len(files) and not list((REPO / "tests").glob("test_*.py"))
