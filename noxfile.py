# /// script
# dependencies = ["nox>=2024.3"]
# ///
"""Sessions: lint, docs, core (no framework), torch, dsa, mindformers, example_mindformers,
example_jax, example_train, nemo_automodel, veomni, megatron, bench, bench_precision,
bench_mindformers, bench_peers (bench_peers_nemo, bench_peers_veomni, bench_peers_dsa), dist,
device, fuzz, clean_exit.

`nox` runs lint, docs, core, torch, mindformers, example_jax, veomni and megatron; each installs
its own distributions (the wheels built once per run) into a fresh virtualenv, so the core is
proven framework-free and every backend is tested with its framework for real. Suites that need
the same heavy install share one virtualenv (Note [Suites sharing a virtualenv]): ``torch`` also
runs the dsa, example_train and nemo_automodel suites, ``mindformers`` the example_mindformers
suite; ``nox -s dsa`` (``example_train``, ``nemo_automodel``, ``example_mindformers``) runs one
of them alone in its own virtualenv. Every backend passes the same installed
contract suite
(`pytest -p hp_cp_core.testing.contract`), through the driver it registers under the
entry-point group `hp_cp.contract`.
"""

from __future__ import annotations

import functools
import glob
import os
import random
import shutil
import zipfile

import nox

nox.needs_version = ">=2024.3"
nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = [
    "lint",
    "docs",
    "core",
    "torch",  # + the dsa, example_train and nemo_automodel suites
    "mindformers",  # + the example_mindformers suite
    "example_jax",
    "veomni",
    "megatron",
]
nox.options.reuse_existing_virtualenvs = True


DROP_VENVS = "HP_CP_NOX_DROP_VENVS"
"""Set to 1 (``.ci/run`` does) to delete each session's virtualenv when the session ends: the
default sessions' virtualenvs hold about 14 GB together, one of them at most 3 GB."""


def _session(**kwargs):
    """``nox.session(**kwargs)`` that deletes the session's virtualenv when it ends, pass or
    fail, if ``HP_CP_NOX_DROP_VENVS=1``. Unset (the default), virtualenvs stay for ``-R``."""

    def decorate(func):
        @functools.wraps(func)
        def run(session: nox.Session) -> None:
            try:
                func(session)
            finally:
                if os.environ.get(DROP_VENVS) == "1":
                    _drop_virtualenv(session)

        return nox.session(**kwargs)(run)

    return decorate


def _drop_virtualenv(session: nox.Session) -> None:
    location = getattr(session.virtualenv, "location", None)
    nox_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".nox")
    if location and os.path.abspath(location).startswith(nox_dir + os.sep):
        session.log(f"{DROP_VENVS}=1: deleting {location}")
        shutil.rmtree(location, ignore_errors=True)


PYTHONS = ["3.11"]
TEST_DEPS = ["pytest>=8", "hypothesis>=6"]
TORCH = "torch==2.13.0"  # the CPU build (a local wheel on the dev machines)
TRANSFORMERS = "transformers==5.23.0"
MINDSPORE = ["mindspore==2.10.0", "numpy<2"]
JAX = "jax==0.10.2"  # CPU
NEMO_AUTOMODEL = "nemo-automodel==0.7.0"  # with --no-deps (plus pillow)
CONTRACT = ("pytest", "-p", "hp_cp_core.testing.contract")
DIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist")
WHEEL_SOURCES = {
    "hp-cp-core": "hp_cp_core",
    "hp-cp-torch": "hp_cp_torch",
    "hp-cp-mindformers": "hp_cp_mindformers",
}
"""The three distributions CI builds once per nox run; test sessions install these wheels."""
_BUILT = os.path.join(DIST, ".built-by-nox")  # marker: the pid of the nox run that built them


def _wheels(session: nox.Session, *requirements: str) -> list[str]:
    """The built wheels of ``requirements`` (``"hp-cp-core[testing]"``, ``"hp-cp-torch"``,
    extras kept) as ``session.install`` arguments, building the three wheels into ``dist/``
    on the first call of this nox run (a marker holds the run's pid). Installing a wheel
    rather than a source folder makes a file missing from the wheel fail the tests.

    Switching a session: ``session.install("./hp_cp_core[testing]", "./hp_cp_torch", ...)``
    becomes ``session.install(*_wheels(session, "hp-cp-core[testing]", "hp-cp-torch"), ...)``.
    """
    run_id = str(os.getpid())  # the nox process: one per run, all its sessions share it
    try:
        with open(_BUILT) as fh:
            built = fh.read().strip() == run_id
    except OSError:
        built = False
    if not built:
        os.makedirs(DIST, exist_ok=True)
        for name, source in WHEEL_SOURCES.items():
            for old in glob.glob(os.path.join(DIST, f"{name.replace('-', '_')}-*.whl")):
                os.remove(old)
            # setuptools packs all of build/lib: a file removed from src/ would still ship
            shutil.rmtree(os.path.join(source, "build"), ignore_errors=True)
        session.run(
            "python",
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--quiet",
            "--wheel-dir",
            DIST,
            *(f"./{d}" for d in WHEEL_SOURCES.values()),
        )
        for name, source in WHEEL_SOURCES.items():
            _check_wheel_modules(session, name, source)
        with open(_BUILT, "w") as fh:
            fh.write(run_id)
    paths, args = [], ["--find-links", DIST]
    for req in requirements:
        name, bracket, extras = req.partition("[")
        if name not in WHEEL_SOURCES:
            session.error(f"_wheels: {name!r} is not one of {sorted(WHEEL_SOURCES)}")
        found = glob.glob(os.path.join(DIST, f"{name.replace('-', '_')}-*.whl"))
        if len(found) != 1:
            session.error(f"_wheels: expected one {name} wheel in {DIST}, found {found}")
        paths.append(found[0])
        args.append(found[0] + bracket + extras)
    # a reused virtualenv holds the same version from an earlier run: replace it by this build
    session.install("--no-deps", "--force-reinstall", "--quiet", *paths)
    return args


def _check_wheel_modules(session: nox.Session, name: str, source: str) -> None:
    """The built wheel of ``name`` holds exactly the ``.py`` files of ``source/src`` (every
    subpackage, nothing stale)."""
    (wheel,) = glob.glob(os.path.join(DIST, f"{name.replace('-', '_')}-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        packed = {n for n in zf.namelist() if n.endswith(".py")}
    src = os.path.join(source, "src")
    tree = {
        os.path.relpath(os.path.join(d, f), src).replace(os.sep, "/")
        for d, _, files in os.walk(src)
        for f in files
        if f.endswith(".py")
    }
    if packed != tree:
        session.error(
            f"{os.path.basename(wheel)}: missing {sorted(tree - packed)}, "
            f"not in {src}: {sorted(packed - tree)}"
        )


VEOMNI = "veomni==0.1.12"  # installed --no-deps; its DeepSeek V4 imports with transformers 5.9
VEOMNI_DEPS = ["transformers==5.9.0", "psutil"]


def _install_veomni(session: nox.Session) -> None:
    session.install(TORCH)
    session.install(
        *_wheels(session, "hp-cp-core[testing]", "hp-cp-torch"),
        "./tests/fakes",
        *VEOMNI_DEPS,
        *TEST_DEPS,
    )
    session.install("--no-deps", VEOMNI)


@_session(python=PYTHONS)
def lint(session: nox.Session) -> None:
    """ruff check and format check over the three distributions and the tests."""
    session.install("ruff==0.17.6")  # format output differs between releases
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@_session(python=PYTHONS)
def docs(session: nox.Session) -> None:
    """The MkDocs (Material) site of docs/ with its API reference (mkdocstrings), built with
    ``--strict`` so a broken link, nav entry or docstring reference fails."""
    session.install(
        *_wheels(session, "hp-cp-core"),
        "mkdocs==1.6.1",
        "mkdocs-material==9.8.1",
        "mkdocstrings==1.0.8",
        "mkdocstrings-python==2.0.11",
    )
    site = os.path.join(session.create_tmp(), "site")
    session.run("mkdocs", "build", "--strict", "--site-dir", site, env={"NO_MKDOCS_2_WARNING": "1"})


@_session(python=PYTHONS)
def core(session: nox.Session) -> None:
    """hp-cp-core alone (pluggy + numpy) with the numpy fake backend: no framework."""
    session.install(*_wheels(session, "hp-cp-core[testing]"), "./tests/fakes", *TEST_DEPS)
    session.run(
        "pytest",
        "tests/core",
        "tests/test_hooks_documented.py",
        "tests/test_no_framework_imports.py",
        "tests/test_import_graph.py",
        *session.posargs,
        env={"HP_CP_REQUIRE_BACKEND": "fake"},
    )
    # fake: the current backend API; legacy: a backend written against 0.1, adapted
    backends = "fake,legacy"
    session.run(
        *CONTRACT, f"--hp-cp-backend={backends}", f"--hp-cp-require={backends}", *session.posargs
    )


# Note [Suites sharing a virtualenv]
#
# Installing torch with transformers (or MindSpore with mindformers) into a fresh virtualenv takes
# minutes on the 2-core CI machine (the torch suites' install: 8 minutes on the shared machine,
# little of it CPU time), so the default sessions install each stack once: ``torch`` installs the
# union of what the torch, dsa, example_train and nemo_automodel suites need (hp-cp-torch with its
# triton, transformers and train extras, NeMo Automodel ``--no-deps``) and runs the four suites in
# turn; ``mindformers`` runs the mindformers suite, then the example_mindformers recipe. Each suite
# keeps its own command lines and environment variables (``_dsa_suite`` ...). With posargs (a pytest
# selection) ``torch`` and ``mindformers`` run their own pytest suites only. The sessions ``dsa``,
# ``example_train``, ``nemo_automodel`` and ``example_mindformers`` (not default) run one suite
# alone in a virtualenv holding only what it needs.


def _install_torch_suites(session: nox.Session) -> None:
    session.install(TORCH)
    session.install(
        *_wheels(session, "hp-cp-core[testing]", "hp-cp-torch[triton,transformers,train]"),
        "./tests/fakes",
        "./tests/model_example",  # a model adapter found only through its entry points
        "./tests/dsa_example",  # the guide's DSA example, also by entry point only
        TRANSFORMERS,
        *TEST_DEPS,
    )
    session.install("-e", "./tests/contract")  # the torch driver runs tests/torch helpers
    # NeMo Automodel's own requirements (GPU stacks) are not needed by its DeepSeek V4 model
    session.install("--no-deps", NEMO_AUTOMODEL, "pillow")


@_session(python=PYTHONS)
def torch(session: nox.Session) -> None:
    """hp-cp-torch on real gloo process groups, with transformers for the HF integration and
    Triton (its kernels run in Triton's CPU interpreter, tests/torch/conftest.py); then, in the
    same virtualenv, the dsa, example_train and nemo_automodel suites (Note [Suites sharing a
    virtualenv]; with posargs, tests/torch and the contract suite only)."""
    _install_torch_suites(session)
    _torch_suite(session)
    if not session.posargs:
        _dsa_suite(session)
        _example_train_suite(session)
        _nemo_automodel_suite(session)


def _torch_suite(session: nox.Session) -> None:
    out = session.run("python", "-m", "hp_cp_core", silent=True)
    rows = [line.split() for line in out.splitlines()]
    if ["torch", "hp-cp-torch", "0.4.0", "0.2", "current", "ok"] not in rows:
        session.error(f"python -m hp_cp_core does not report `torch ... 0.2 current ok`:\n{out}")
    session.run(
        "pytest",
        "tests/torch",
        "--ignore=tests/torch/test_transformers_dsa.py",  # the dsa suite runs it
        *session.posargs,
        env={
            "HP_CP_REQUIRE_BACKEND": "fake,torch,transformers,triton",
            "HP_CP_CLEAN_EXIT_RUNS": "3",  # nox -s clean_exit runs the twenty
        },
    )
    session.run(*CONTRACT, "--hp-cp-backend=torch", "--hp-cp-require=torch", *session.posargs)


MEGATRON = "megatron-core==0.19.2"
"""Declares Python >= 3.12, but its cp311 wheel imports and runs on 3.11: installed with
``--ignore-requires-python`` (a plain install on 3.11 resolves to 0.16.1, an older DSA)."""


@_session(python=PYTHONS)
def megatron(session: nox.Session) -> None:
    """megatron-core 0.19.2's GPTModel of MLA + DSA layers (Megatron's own spec) under hp_cp
    through Megatron's forward_backward_func: cp 1, 2, 3, 4 (one gloo job each) against the same
    model on one process; Triton is installed for ``import megatron.core`` (or the test-side
    stub in tests/megatron/megatron_shims.py), the CPU shims are test fixtures."""
    session.install(TORCH)
    session.install(
        *_wheels(session, "hp-cp-core[testing]", "hp-cp-torch[triton]"),
        *TEST_DEPS,
    )
    session.install("--ignore-requires-python", MEGATRON)
    session.run(
        "pytest",
        "tests/megatron",
        *session.posargs,
        env={"OMP_NUM_THREADS": "1", "HP_CP_REQUIRE_BACKEND": "megatron"},
    )


@_session(python=PYTHONS, default=False)
def dsa(session: nox.Session) -> None:
    """transformers' DSA models under hp_cp: DeepSeek V3.2 and GLM-5 (cp 1, 2, 3, 4, 8 in one
    8-rank gloo job against one process), then the three docs snippets under torchrun (GLM-5
    in pipeline stages on 4 ranks among them). The
    default ``torch`` session runs this suite too."""
    session.install(TORCH)
    session.install(
        *_wheels(session, "hp-cp-core[testing]", "hp-cp-torch[transformers]"),
        "./tests/fakes",
        TRANSFORMERS,
        *TEST_DEPS,
    )
    session.install("-e", "./tests/contract")
    _dsa_suite(session)


def _dsa_suite(session: nox.Session) -> None:
    env = {"OMP_NUM_THREADS": "1"}
    session.run(
        "pytest",
        "tests/torch/test_transformers_dsa.py",
        *session.posargs,
        env={**env, "HP_CP_REQUIRE_BACKEND": "torch,transformers"},
    )
    for snippet, ranks in (("deepseek_v32", 2), ("glm_moe_dsa", 2), ("pipeline_glm5", 4)):
        session.run(
            "torchrun",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            f"examples/snippets/{snippet}.py",
            env=env,
        )


def _install_mindformers(session: nox.Session) -> None:
    session.install(*MINDSPORE)
    session.install(
        *_wheels(session, "hp-cp-core[testing]", "hp-cp-mindformers"),
        "./tests/fakes",
        *TEST_DEPS,
        "numpy<2",
    )
    session.install("-e", "./tests/contract")  # the mindformers driver runs msrun workers
    # mindformers' own dependencies are not all on PyPI; these three let the real
    # CompressedSparseAttention class import (the rest are stubbed by the tests).
    session.install("--no-deps", "mindformers==2.1.0")
    session.install("pyyaml", "regex", "deprecated")


@_session(python=PYTHONS)
def mindformers(session: nox.Session) -> None:
    """hp-cp-mindformers on MindSpore (CPU, PyNative), cp = 1 in-process and 2, 4 under msrun;
    then, in the same virtualenv, the example_mindformers suite (Note [Suites sharing a
    virtualenv]; with posargs, the pytest suites only).

    ``-- -m real_mindformers`` runs only the real mindformers 2.1.0 cell under msrun.
    """
    _install_mindformers(session)
    session.run(
        "pytest",
        "tests/mindformers",
        *session.posargs,
        env={"HP_CP_REQUIRE_BACKEND": "fake,mindformers", "HP_CP_MSRUN_BIN": session.bin},
    )
    # a marker selection (-m real_mindformers) may deselect the whole contract suite (exit 5)
    session.run(
        *CONTRACT,
        "--hp-cp-backend=mindformers",
        "--hp-cp-require=mindformers",
        *session.posargs,
        env={"HP_CP_MSRUN_BIN": session.bin},
        success_codes=[0, 5] if "-m" in session.posargs else [0],
    )
    if not session.posargs:
        _example_mindformers_suite(session)


@_session(python=PYTHONS, default=False)
def example_mindformers(session: nox.Session) -> None:
    """examples/train_mindformers_cp.py (mindformers' PyNativeDeepseekV4ForCausalLM, CPU with the
    test stand-ins): 3 steps on one process; then 2 steps at cp 2 under msrun, saved, and
    resumed at cp 4 for step 3; both msrun runs check their losses equal the one-process
    run's (``--expect``). The default ``mindformers`` session runs this suite too."""
    _install_mindformers(session)
    _example_mindformers_suite(session)


def _example_mindformers_suite(session: nox.Session) -> None:
    tmp = os.path.abspath(session.create_tmp())
    recipe = os.path.abspath("examples/train_mindformers_cp.py")
    common = [recipe, "--cpu-standins", os.path.abspath("tests/mindformers")]
    one, ckpt = os.path.join(tmp, "one_process.json"), os.path.join(tmp, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    if os.path.exists(one):
        os.remove(one)
    env = {"GLOG_v": "3"}

    def msrun(n: int) -> list[str]:
        port = random.randint(20000, 40000)
        return [
            "msrun",
            f"--worker_num={n}",
            f"--local_worker_num={n}",
            f"--master_port={port}",
            f"--log_dir={os.path.join(tmp, f'logs_cp{n}')}",
            "--join=True",
            "--tail_worker_log=0",
        ]

    with session.chdir(tmp):  # mindformers logs to ./output/log
        session.run("python", *common, "--steps", "3", "--losses", one, env=env)
        session.run(*msrun(2), *common, "--steps", "2", "--save", ckpt, "--expect", one, env=env)
        session.run(*msrun(4), *common, "--steps", "3", "--resume", ckpt, "--expect", one, env=env)


@_session(python=PYTHONS)
def example_jax(session: nox.Session) -> None:
    """A third-party backend as a user would ship it: examples/hp-cp-jax (JAX on CPU, its own
    layer) and hp-cp-core[testing], installed (not editable) into a fresh virtualenv, pass the
    installed contract suite at cp 1..4, run outside the repository (no file from tests/)."""
    session.install(JAX)
    session.install(*_wheels(session, "hp-cp-core[testing]"), "./examples/hp-cp-jax")
    tmp = session.create_tmp()
    with open(os.path.join(tmp, "pytest.ini"), "w") as fh:  # not the repository's config
        fh.write("[pytest]\n")
    session.chdir(tmp)
    session.run(
        *CONTRACT,
        "--hp-cp-require=jax",
        "--hp-cp-max-cp=4",
        *session.posargs,
        env={"XLA_FLAGS": "--xla_backend_optimization_level=0"},  # JAX compiles every op shape
    )


@_session(python=PYTHONS, default=False)
def example_train(session: nox.Session) -> None:
    """examples/train_deepseek_v4_cp.py on 4 gloo ranks (dp 2 x cp 2, FSDP2): 3 steps and a
    checkpoint, then resumed from it for 2 more steps; checks the loss-curve PNG. Then the
    recipe under HF's DistributedConfig (``--hf-parallel tp2,ep2,fsdp2``, CP on ``fsdp``, 2
    steps) and docs/training.md's snippet (examples/snippets/hf_distributed_config.py). The
    default ``torch`` session runs this suite too."""
    session.install(TORCH)
    session.install(*_wheels(session, "hp-cp-core", "hp-cp-torch[train]"), TRANSFORMERS)
    _example_train_suite(session)


def _example_train_suite(session: nox.Session) -> None:
    tmp = session.create_tmp()
    ckpt, png = os.path.join(tmp, "ckpt"), os.path.join(tmp, "train_loss.png")
    shutil.rmtree(ckpt, ignore_errors=True)
    run = ["torchrun", "--standalone", "--nproc-per-node", "4", "examples/train_deepseek_v4_cp.py"]
    args = ["--dp", "2", "--cp", "2", "--seq-len", "101", "--plot", png]
    env = {"OMP_NUM_THREADS": "1"}
    session.run(*run, *args, "--steps", "3", "--save", ckpt, env=env)
    os.remove(png)
    session.run(*run, *args, "--steps", "5", "--resume", ckpt, env=env)
    if not os.path.getsize(png):
        session.error(f"no loss curve at {png}")
    hf = ["--hf-parallel", "tp2,ep2,fsdp2", "--cp-axis", "fsdp", "--seq-len", "101"]
    session.run(*run, *hf, "--steps", "2", "--plot", png, env=env)
    snippet = "examples/snippets/hf_distributed_config.py"
    session.run(*run[:-1], snippet, env=env)


def _install_nemo_automodel(session: nox.Session) -> None:
    session.install(TORCH)
    session.install(
        *_wheels(session, "hp-cp-core[testing]", "hp-cp-torch"), "./tests/fakes", TRANSFORMERS
    )
    session.install(*TEST_DEPS)
    # NeMo Automodel's own requirements (GPU stacks) are not needed by its DeepSeek V4 model
    session.install("--no-deps", NEMO_AUTOMODEL, "pillow")


@_session(python=PYTHONS, default=False)
def nemo_automodel(session: nox.Session) -> None:
    """NeMo Automodel 0.7.0's own DeepSeek V4, V4.1 and GLM-5 models under hp_cp on gloo ranks
    (cp 1-4, 8) against one process, then the docs snippets under torchrun with 2 ranks. The
    default ``torch`` session runs this suite too."""
    _install_nemo_automodel(session)
    _nemo_automodel_suite(session)


def _nemo_automodel_suite(session: nox.Session) -> None:
    env = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    session.run(
        "pytest",
        "tests/nemo_automodel",
        *session.posargs,
        env={**env, "HP_CP_REQUIRE_BACKEND": "torch,nemo_automodel"},
    )
    snippet = ["torchrun", "--standalone", "--nproc-per-node", "2"]
    # PYTHONSAFEPATH: the snippet's folder must not shadow the nemo_automodel package
    session.run(*snippet, "examples/snippets/nemo_automodel.py", env={**env, "PYTHONSAFEPATH": "1"})
    for name in ("nemo_automodel_v41", "nemo_automodel_glm5"):
        session.run(*snippet, f"examples/snippets/{name}.py", env={**env, "PYTHONSAFEPATH": "1"})


@_session(venv_backend="none", default=False)
def bench_peers(session: nox.Session) -> None:
    """hp_cp side by side with each peer stack's own CP inside its model: bench-peers.json
    (bench_peers_nemo, bench_peers_veomni and bench_peers_dsa, each in its own virtualenv)."""
    session.notify("bench_peers_nemo", session.posargs)
    session.notify("bench_peers_veomni", session.posargs)
    session.notify("bench_peers_dsa", session.posargs)


@_session(python=PYTHONS, default=False)
def bench_peers_dsa(session: nox.Session) -> None:
    """hp_cp vs the all-gather CP of the public DSA code inside transformers' DeepSeek V3.2
    and GLM-5 (gloo, cp 2 and 4; memory at cp 4): the dsa_allgather_* keys of
    bench-peers.json."""
    session.install(TORCH)
    session.install(
        *_wheels(session, "hp-cp-core", "hp-cp-torch[transformers]"), TRANSFORMERS, *TEST_DEPS
    )
    env = {"OMP_NUM_THREADS": "1"}
    session.run("python", "bench/peers_dsa.py", *session.posargs, env=env)


@_session(python=PYTHONS, default=False)
def bench_peers_nemo(session: nox.Session) -> None:
    """hp_cp vs NeMo Automodel's own DeepSeek V4 and V4.1 CP inside NeMo's models (gloo, cp 2
    and 4): updates the nemo_* and nemo_v41_* keys of bench-peers.json."""
    _install_nemo_automodel(session)
    env = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    session.run("python", "bench/peers_nemo.py", *session.posargs, env=env)
    session.run("python", "bench/peers_nemo_v41.py", *session.posargs, env=env)


@_session(python=PYTHONS)
def veomni(session: nox.Session) -> None:
    """hp_cp inside VeOmni's DeepSeek V4 on gloo ranks (tests/veomni: cp 2, 4, 8), and the
    snippet of docs/veomni.md on 2 torchrun ranks."""
    _install_veomni(session)
    env = {"HP_CP_REQUIRE_BACKEND": "veomni", "OMP_NUM_THREADS": "1"}
    session.run("pytest", "tests/veomni", *session.posargs, env=env)
    session.run(
        "torchrun",
        "--nproc-per-node",
        "2",
        "--no-python",
        "python",
        "-P",  # the snippet is named veomni.py: its folder must not shadow the package
        "examples/snippets/veomni.py",
        env=env,
    )


@_session(python=PYTHONS, default=False)
def bench_peers_veomni(session: nox.Session) -> None:
    """VeOmni's own CP vs hp_cp inside VeOmni's model (cp 2, 4): the veomni_* keys of
    bench-peers.json."""
    _install_veomni(session)
    session.run("python", "bench/peers_veomni.py", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@_session(python=PYTHONS, default=False)
def bench_mindformers(session: nox.Session) -> None:
    """hp_cp vs MindFormers' own CSA CP on the real cell (msrun, cp 4): bench-mindformers.json."""
    _install_mindformers(session)
    session.run(
        "python",
        "bench/mindformers_side_by_side.py",
        *session.posargs,
        env={"HP_CP_MSRUN_BIN": session.bin},
    )


@_session(python=PYTHONS, default=False)
def bench(session: nox.Session) -> None:
    """`hp-cp bench`: bench.json and bench.png (traffic, balance, memory, time)."""
    session.install(TORCH)
    session.install(*_wheels(session, "hp-cp-core", "hp-cp-torch[bench]"))
    session.run("hp-cp", "bench", *session.posargs)


@_session(python=PYTHONS, default=False)
def bench_long(session: nox.Session) -> None:
    """`hp-cp bench --long`: bench-long.json and docs/bench-long.png (one training step of the
    reference layers at cp 8 per S, 64K ... 1M, one process per rank; the scale on paper)."""
    session.install(TORCH)
    session.install(*_wheels(session, "hp-cp-core", "hp-cp-torch[bench]"))
    session.run("hp-cp", "bench", "--long", *session.posargs)


@_session(python=PYTHONS, default=False)
def bench_real(session: nox.Session) -> None:
    """`hp-cp bench --real-widths`: bench-real.json and docs/bench-real.png (bf16 training
    steps of V4-Flash, V3.2 and GLM-5 at their published attention widths, 2 layers, at cp 4
    and 8 for S = 4096, 8192 ..., regather on and off, one gloo process per rank; hours on
    a few cores). Pass one point at a time to stay inside a time window, e.g.
    `nox -s bench_real -- --real-models deepseek_v4 --real-cps 4 --real-seqs 4096`."""
    session.install(TORCH)
    session.install(*_wheels(session, "hp-cp-core", "hp-cp-torch[bench]"))
    session.run("hp-cp", "bench", "--real-widths", *session.posargs)


@_session(python=PYTHONS, default=False)
def bench_precision(session: nox.Session) -> None:
    """`python -m hp_cp_torch.bench.precision`: bf16 under CP against the fp32 model, one
    process in bf16 as the bar, at the published attention widths of HF's V4, V3.2 and GLM-5
    (five seeds, cp 2-4): keys in bench-real.json, details in bench-real-precision.json.
    Posargs replace the defaults."""
    session.install(TORCH, TRANSFORMERS)
    session.install(*_wheels(session, "hp-cp-core", "hp-cp-torch"))
    args = session.posargs or ["--seeds", "5", "--seq", "256", "--layers", "1"]
    session.run("python", "-m", "hp_cp_torch.bench.precision", *args, env={"OMP_NUM_THREADS": "1"})


@_session(python=PYTHONS, default=False)
def dist(session: nox.Session) -> None:
    """The three wheels the test sessions install (built once per nox run into ``dist/``),
    installed without their frameworks: the entry points and the core's CLI work from them."""
    session.install("--no-deps", *_wheels(session, *WHEEL_SOURCES))
    session.install("pluggy", "numpy")
    session.run(
        "python",
        "-c",
        "import importlib.metadata as m; names = {e.name for e in m.entry_points(group='hp_cp')};"
        "assert {'torch', 'mindformers'} <= names, names; print(sorted(names))",
    )
    out = session.run("python", "-m", "hp_cp_core", silent=True)
    if "0.2 current" not in out:
        session.error(f"python -m hp_cp_core does not report the backends current:\n{out}")


@_session(python=PYTHONS, default=False)
def clean_exit(session: nox.Session) -> None:
    """A 4-rank training script that ends without ``dist.barrier()``, twenty times: every
    rank exits 0 (Note [Clean exit] in ``hp_cp_torch/distributed/exit.py``; the torch session
    runs it three times)."""
    session.install(TORCH)
    session.install(*_wheels(session, "hp-cp-core", "hp-cp-torch"), *TEST_DEPS)
    session.run("pytest", "tests/torch/test_clean_exit.py", *session.posargs)


@_session(python=PYTHONS, default=False)
def fuzz(session: nox.Session) -> None:
    """Randomised CP-vs-single-device parity on gloo ranks, with a random seed (printed).

    ``HP_CP_FUZZ_SEED`` repeats a run, ``HP_CP_FUZZ_CASES`` (default 200) and
    ``HP_CP_FUZZ_WORLDS`` (cp sizes, default ``2,3,4,8``) size it; the cases come from
    ``tests/torch/fuzz_cases.py``, the same generator the torch session runs with a fixed seed.
    """
    session.install(TORCH)
    session.install(*_wheels(session, "hp-cp-core", "hp-cp-torch"), *TEST_DEPS)
    seed = os.environ.get("HP_CP_FUZZ_SEED") or str(random.SystemRandom().randrange(2**31))
    cases = os.environ.get("HP_CP_FUZZ_CASES", "200")
    worlds = os.environ.get("HP_CP_FUZZ_WORLDS", "2,3,4,8")
    session.log(f"fuzz: seed {seed}, {cases} cases, cp {worlds} (repeat: HP_CP_FUZZ_SEED={seed})")
    session.run(
        "pytest",
        "tests/torch/test_fuzz.py",
        *session.posargs,
        env={"HP_CP_FUZZ_SEED": seed, "HP_CP_FUZZ_CASES": cases, "HP_CP_FUZZ_WORLDS": worlds},
    )


@_session(python=PYTHONS, default=False)
def device(session: nox.Session) -> None:
    """GPU checks: the Triton kernel's parity and benchmark (scripts/device_triton.py, JSON to
    ``$HP_CP_DEVICE_JSON`` or ./triton2.json), then multi-GPU torchrun (NCCL)."""
    session.install(*_wheels(session, "hp-cp-core", "hp-cp-torch[triton]"))
    session.run("python", "scripts/device_triton.py", *session.posargs)
    session.run("bash", "scripts/device_check.sh", external=True)
