"""How torch's own FSDP test files fare when moved to fsdp_testing by an import change.

For every ``test_*.py`` under DIRECTORY (a copy of torch's ``test/distributed/fsdp/``,
``test/distributed/_composable/fsdp/`` or ``test/distributed/tensor/`` (with ``parallel/``) for
the torch release you use; they are not in the torch wheel, get them from the torch source tree
or repository at that release's tag), the script:

1. ports the file mechanically: ``torch.testing._internal.common_fsdp`` /
   ``common_distributed`` / ``common_utils`` / ``distributed._tensor.common_dtensor`` become
   ``fsdp_testing.common_fsdp`` / ... / ``fsdp_testing.common_dtensor`` and nothing else
   changes;
2. runs the ported file with our harness (pytest, CPU ranks over gloo; ``--engine`` selects
   what the reference models shard with: ``torch_fsdp1`` by default, ``fsdp_core`` for ours);
3. runs the original file with torch's own harness (pytest with our plugin disabled);

and prints, per file and harness: passed, failed, skipped (with the reasons, most frequent
first), collection errors and wall time. The other files under DIRECTORY (modules the tests
import from their own folder, data files they read beside them) are copied next to the test
files for both harnesses, ported like them for ours. ``--json PATH`` writes the same as JSON.

``--bare FILE::CLASS::METHOD`` tells a harness failure from a body's own: it runs one method of
the original (unported) file on ``--world-size`` CPU processes that share a plain gloo group, with
no test harness around it (no pytest, no rank pool, none of torch's spawning). The only change is
that torch's GPU-count gate ``skip_if_lt_x_gpu`` gets its own ``allow_cpu=True``, so the body
runs. Each rank prints PASSED, SKIPPED or FAILED with the error; the exit status is 1 when a rank
failed.

Usage:
    python benchmarks/torch_compat.py DIRECTORY [--harness ours|torch|both]
        [--engine NAME] [--timeout SECONDS] [--cpu-world-size N] [-k EXPR] [--json PATH]
    python benchmarks/torch_compat.py --bare FILE::CLASS::METHOD [--world-size N]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import unittest
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

# torch's harness modules and their mirrors: a ported file imports the mirror instead.
MIRRORS = {
    "torch.testing._internal.common_fsdp": "fsdp_testing.common_fsdp",
    "torch.testing._internal.common_distributed": "fsdp_testing.common_distributed",
    "torch.testing._internal.common_utils": "fsdp_testing.common_utils",
    "torch.testing._internal.distributed._tensor.common_dtensor": "fsdp_testing.common_dtensor",
}
_IMPORT = re.compile(r"\b(" + "|".join(re.escape(m) for m in MIRRORS) + r")\b")


def port_source(source: str, *, engine: str | None = None) -> str:
    """The file with its imports of torch's four harness modules (``common_fsdp``,
    ``common_distributed``, ``common_utils``, ``distributed._tensor.common_dtensor``) pointed
    at fsdp_testing's mirrors, and with ``engine="fsdp_core"`` its FSDP2 imports pointed at
    fsdp_core too (see :func:`_fsdp2_names`)."""
    ported = _IMPORT.sub(lambda m: MIRRORS[m.group(1)], source)
    ported = _rewrite_from_imports(ported, _mirrored_submodules)
    ported = _rewrite_from_imports(ported, _names_the_mirror_lacks)
    return _rewrite_from_imports(ported, _fsdp2_names) if engine == "fsdp_core" else ported


def _mirrored_submodules(module: str, names: list[str]) -> tuple[str, list[str]] | None:
    """``from torch.testing._internal import common_utils, logging_utils``: the mirrored
    modules (``common_utils``) come from fsdp_testing, the others stay torch's."""
    picked = [n for n in names if f"{module}.{n}" in MIRRORS]
    return ("fsdp_testing", picked) if picked else None


def _names_the_mirror_lacks(module: str, names: list[str]) -> tuple[str, list[str]] | None:
    """Names imported from a mirror module that it does not define (torch's utilities that are
    not harness machinery, e.g. ``device_sleep``): they stay torch's."""
    torch_module = next((t for t, m in MIRRORS.items() if m == module), None)
    if torch_module is None:
        return None
    mirror = importlib.import_module(module)
    return torch_module, [n for n in names if not hasattr(mirror, n)]


def _fsdp2_names(module: str, names: list[str]) -> tuple[str, list[str]] | None:
    """torch's FSDP2 public names, taken from fsdp_core (``--engine fsdp_core``)."""
    mapped = _FSDP2_MODULES.get(module)
    return None if mapped is None else ("fsdp_core", [n for n in names if n in mapped])


# torch's FSDP2 public names, by the modules a test file may import them from; with
# ``--engine fsdp_core`` each becomes fsdp_core's. torch's DDP-based
# ``torch.distributed._composable.replicate`` is the reference the FSDP2 tests compare
# against, so it stays torch's; the FSDP2-style one (``replicate_with_fsdp``) is mapped.
_FSDP2_NAMES = frozenset(
    {
        "CPUOffloadPolicy",
        "DataParallelMeshDims",
        "FSDPModule",
        "MixedPrecisionPolicy",
        "OffloadPolicy",
        "UnshardHandle",
        "fully_shard",
        "register_fsdp_forward_method",
        "share_comm_ctx",
    }
)
_FSDP2_MODULES = {
    "torch.distributed.fsdp": _FSDP2_NAMES,
    "torch.distributed.fsdp._fully_shard": _FSDP2_NAMES,
    "torch.distributed.fsdp._fully_shard._fully_shard": _FSDP2_NAMES,
    "torch.distributed.fsdp._fully_shard._fsdp_api": _FSDP2_NAMES,
    "torch.distributed._composable.fsdp": _FSDP2_NAMES,
    "torch.distributed._composable.fsdp.fully_shard": _FSDP2_NAMES,
    "torch.distributed._composable.replicate_with_fsdp": frozenset({"replicate"}),
}


def _rewrite_from_imports(
    source: str, choose: Callable[[str, list[str]], tuple[str, list[str]] | None]
) -> str:
    """``source`` with the names ``choose(module, names)`` picks out of each ``from module
    import names`` statement imported from the module it names instead (aliases kept); the other
    names stay where they were. Statements are rewritten in place, at their indentation."""
    import ast

    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom) or node.level or node.module is None:
            continue
        chosen = choose(node.module, [a.name for a in node.names])
        if chosen is None or not chosen[1] or node.end_lineno is None:
            continue
        target, picked = chosen
        first, last = node.lineno - 1, node.end_lineno - 1
        if lines[first][: node.col_offset].strip() or lines[last][node.end_col_offset :].strip():
            continue  # shares its line with another statement: leave it alone
        indent = lines[first][: node.col_offset]

        def statement(module: str, aliases: list[ast.alias], indent: str = indent) -> str:
            names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in aliases)
            return f"{indent}from {module} import {names}\n"

        text = statement(target, [a for a in node.names if a.name in picked])
        rest = [a for a in node.names if a.name not in picked]
        if rest:
            text += statement(node.module, rest)
        edits.append((first, last, text))
    for first, last, text in sorted(edits, reverse=True):
        lines[first : last + 1] = [text]
    return "".join(lines)


@dataclasses.dataclass
class FileResult:
    file: str
    harness: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    seconds: float = 0.0
    timed_out: bool = False
    skip_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    failures: dict[str, str] = dataclasses.field(default_factory=dict)

    def row(self) -> str:
        status = "TIMEOUT" if self.timed_out else ""
        reasons = "; ".join(f"{n}x {r}" for r, n in list(self.skip_reasons.items())[:3])
        return (
            f"{self.file:<48} {self.harness:<6} {self.passed:>6} {self.failed:>6} "
            f"{self.skipped:>7} {self.errors:>6} {self.seconds:>8.1f} {status} {reasons}"
        )


def _short(text: str, limit: int = 160) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _read_junit(path: Path, result: FileResult) -> None:
    reasons: collections.Counter[str] = collections.Counter()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag == "skipped":
                outcome = "skipped"
                reasons[_short(child.get("message", ""))] += 1
            elif child.tag == "failure":
                outcome = "failed"
                result.failures[name] = _short(child.get("message", ""), 400)
            elif child.tag == "error":
                outcome = "error"
                result.failures[name] = _short(child.get("message", ""), 400)
        if outcome == "passed":
            result.passed += 1
        elif outcome == "skipped":
            result.skipped += 1
        elif outcome == "failed":
            result.failed += 1
        else:
            result.errors += 1
    result.skip_reasons = dict(reasons.most_common())


def is_test_file(path: Path) -> bool:
    """Whether ``path`` is one of the test files the script runs (``test_*.py``)."""
    return path.name.startswith("test_") and path.suffix == ".py"


def copy_helpers(root: Path, target: Path, *, port: bool, engine: str | None = None) -> list[Path]:
    """Copy everything under ``root`` but its test files to ``target``, keeping the layout:
    the modules the tests import from their own folder (torch's pipelining tests import
    ``model_registry`` and ``schedule_registry``) and the data files they read beside them
    (``artifacts/*.csv``). With ``port`` (our harness) Python modules are ported as the test
    files are, for ``engine``; other files are copied as they are. Returns the paths written."""
    written = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if path.is_dir() or is_test_file(path) or "__pycache__" in relative.parts:
            continue
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        if port and path.suffix == ".py":
            destination.write_text(port_source(path.read_text(), engine=engine))
        else:
            shutil.copyfile(path, destination)
        written.append(destination)
    return written


def run_file(
    source: Path, root: Path, harness: str, args: argparse.Namespace, workdir: Path
) -> FileResult:
    """Run one test file under one harness in its own pytest process."""
    rel = str(source.relative_to(root))
    result = FileResult(rel, harness)
    target_dir = workdir / harness / source.parent.relative_to(root)
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / source.name
    text = source.read_text()
    target.write_text(port_source(text, engine=args.engine) if harness == "ours" else text)
    xml = target.with_suffix(".xml")
    command = [sys.executable, "-m", "pytest", str(target), "-p", "no:cacheprovider"]
    command += ["-p", "no:randomly", f"--junitxml={xml}", "-q", "-rN"]
    command += ["--rootdir", str(target_dir), "-o", "addopts="]
    env = dict(os.environ)
    if harness == "ours":
        if args.engine:
            command += ["--fsdp-engine", args.engine]
        if args.cpu_world_size:
            command += ["--cpu-world-size", str(args.cpu_world_size)]
    else:
        command += ["-p", "no:fsdp_testing"]
    if args.k:
        command += ["-k", args.k]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            command,
            cwd=target_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
    except subprocess.TimeoutExpired:
        result.timed_out = True
        result.seconds = time.monotonic() - start
        return result
    result.seconds = time.monotonic() - start
    if xml.exists():
        _read_junit(xml, result)
    if not xml.exists() or proc.returncode in (2, 3, 4):
        result.errors = max(result.errors, 1)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        result.failures.setdefault("<collection>", _short(" | ".join(tail), 400))
    return result


def _allow_cpu_in_gpu_gates() -> None:
    """Give torch's ``skip_if_lt_x_gpu`` its ``allow_cpu=True`` in every harness module that
    exports it, before the test file imports the name."""
    # The harness modules that re-export the gate are imported first, so each copy is replaced.
    for name in ("common_fsdp", "distributed._tensor.common_dtensor"):
        importlib.import_module(f"torch.testing._internal.{name}")
    common_distributed = importlib.import_module("torch.testing._internal.common_distributed")
    gate = common_distributed.skip_if_lt_x_gpu
    cpu_gate: Callable[..., Any]
    if "allow_cpu" in inspect.signature(gate).parameters:
        cpu_gate = functools.partial(gate, allow_cpu=True)
    else:  # an older torch's gate has no allow_cpu: what allow_cpu=True does, by hand

        def cpu_gate(x: int) -> Callable[[Any], Any]:
            import torch

            accelerator = torch.cuda.is_available() or any(
                getattr(common_distributed, flag, False) for flag in ("TEST_HPU", "TEST_XPU")
            )
            return gate(x) if accelerator else lambda func: func

    for name, module in list(sys.modules.items()):
        if (
            name.startswith("torch.testing._internal")
            and getattr(module, "skip_if_lt_x_gpu", None) is gate
        ):
            module.skip_if_lt_x_gpu = cpu_gate  # type: ignore[attr-defined]


def _bare_rank(
    rank: int, path: str, class_name: str, method: str, world_size: int, port: int, out: str
) -> None:
    """One rank of a bare run, forked with the gates already given ``allow_cpu``: join a gloo
    group (a DTensor class's ``with_comms`` joins it itself, through its ``init_pg``), build the
    test case, call the method."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        spec = importlib.util.spec_from_file_location(f"bare_{Path(path).stem}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cls = getattr(module, class_name)
        # The world is the one asked for, whatever the class computes from GPU counts.
        sized = type(cls.__name__, (cls,), {"world_size": property(lambda self: world_size)})
        case = sized(method)
        case.rank = rank
        if hasattr(case, "init_pg"):
            case.file_name = str(Path(out, "rendezvous"))  # torch's init_pg: file://{file_name}
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        getattr(case, method)()
        outcome, detail = "PASSED", ""
    except unittest.SkipTest as exc:
        outcome, detail = "SKIPPED", str(exc)
    except SystemExit as exc:
        # torch's rank-side skips exit with a code from TEST_SKIPS; any other code is a failure
        skips = importlib.import_module("torch.testing._internal.common_distributed").TEST_SKIPS
        messages = {skip.exit_code: skip.message for skip in skips.values()}
        if exc.code in messages:
            outcome, detail = "SKIPPED", messages[exc.code]
        else:
            outcome, detail = "FAILED", f"the body called sys.exit({exc.code})"
    except Exception as exc:  # the body's own failure, reported with its traceback
        outcome = "FAILED"
        detail = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-4)}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"outcome": outcome, "detail": detail}))


def run_bare(target: str, world_size: int) -> int:
    """Run FILE::CLASS::METHOD on ``world_size`` bare gloo processes; 1 if any rank failed."""
    import socket

    import torch.multiprocessing as mp

    path, class_name, method = target.split("::")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # torch and its harness modules are imported once, here, and the ranks are forked: plain
    # processes all the same (spawned ones would import torch again each, seconds apiece).
    _allow_cpu_in_gpu_gates()
    with tempfile.TemporaryDirectory(prefix="torch-bare-") as out:
        mp.start_processes(
            _bare_rank,
            args=(str(Path(path).resolve()), class_name, method, world_size, port, out),
            nprocs=world_size,
            start_method="fork",
        )
        failed = False
        for rank in range(world_size):
            result = json.loads(Path(out, f"rank{rank}.json").read_text())
            failed |= result["outcome"] == "FAILED"
            print(f"[rank {rank}] {result['outcome']} {result['detail']}".rstrip(), flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "directory", type=Path, nargs="?", help="folder of torch test files (recursive)"
    )
    parser.add_argument("--harness", choices=("ours", "torch", "both"), default="both")
    parser.add_argument(
        "--engine",
        default=None,
        help="--fsdp-engine for our harness (default: the mirror's, torch_fsdp1)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per file and harness")
    parser.add_argument("--cpu-world-size", type=int, default=None)
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--json", type=Path, default=None, help="write results as JSON")
    parser.add_argument("--keep", type=Path, default=None, help="keep the ported files here")
    parser.add_argument(
        "--bare",
        metavar="FILE::CLASS::METHOD",
        default=None,
        help="run one method of an original file on bare gloo CPU processes, no harness",
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks of a --bare run")
    args = parser.parse_args(argv)
    if args.bare is not None:
        if args.bare.count("::") != 2:
            parser.error(f"--bare takes FILE::CLASS::METHOD, got {args.bare!r}")
        return run_bare(args.bare, args.world_size)
    if args.directory is None:
        parser.error("give a DIRECTORY of torch test files, or --bare FILE::CLASS::METHOD")

    root = args.directory.resolve()
    if not root.is_dir():
        parser.error(f"{root} is not a directory of torch test files")
    files = sorted(path for path in root.rglob("test_*.py") if is_test_file(path))
    if not files:
        parser.error(f"no test_*.py files under {root}")
    harnesses = ("ours", "torch") if args.harness == "both" else (args.harness,)
    workdir = Path(tempfile.mkdtemp(prefix="torch-compat-"))
    results: list[FileResult] = []
    print(
        f"{'file':<48} {'harness':<6} {'passed':>6} {'failed':>6} {'skipped':>7} "
        f"{'errors':>6} {'wall s':>8}  skip reasons"
    )
    for harness in harnesses:
        copy_helpers(root, workdir / harness, port=harness == "ours", engine=args.engine)
    try:
        for source in files:
            for harness in harnesses:
                result = run_file(source, root, harness, args, workdir)
                results.append(result)
                print(result.row(), flush=True)
                for name, message in result.failures.items():
                    print(f"    FAIL {name}: {message}", flush=True)
    finally:
        if args.keep is not None:
            shutil.copytree(workdir, args.keep, dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
    for harness in harnesses:
        mine = [r for r in results if r.harness == harness]
        print(
            f"TOTAL {harness}: {sum(r.passed for r in mine)} passed, "
            f"{sum(r.failed for r in mine)} failed, {sum(r.skipped for r in mine)} skipped, "
            f"{sum(r.errors for r in mine)} errors, {sum(r.seconds for r in mine):.0f} s"
        )
    if args.json is not None:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
