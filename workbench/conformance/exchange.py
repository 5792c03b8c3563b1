"""Conformance problems as self-contained files, for kernels written outside Python-Triton (CUDA, CUTLASS, another
framework), and the judging of their outputs by the same rules as :mod:`workbench.conformance.judge`.

    export_problems(cases, "problems/")        # problems/<name>.safetensors + problems/manifest.json
    ... an outside program reads each file and writes problems/<name>.out.safetensors ...
    report = judge_outputs("problems/")        # a Report, as check() gives

A problem file is safetensors (readable from C++, Rust, Python without torch): every input tensor of the op under
its argument name, caches as their raw ``[num_blocks, block_stride]`` planes (padding and in-block scales
included), the reference answer under ``ref`` (decode: float32 ``[B, Hq, D]``; write: ``ref.k_cache`` /
``ref.v_cache`` planes, and the planes before the write as ``before.k_cache`` / ``before.v_cache``; copy:
``ref.pool``), and string metadata: the case id and fields, scalars (``sm_scale``,
``block_size``, ``max_seq_len``), each cache's layout view (shape and strides in elements over its plane) and
what the output file must hold (``outputs``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workbench.conformance.implementations import Impl, get
from workbench.conformance.judge import CaseResult, judge_bytes, judge_decode, judge_write
from workbench.conformance.problems import Case
from workbench.conformance.suite import Report
from workbench.conformance.suite_formats import SUITE_FORMATS
from workbench.quant import blocks as qblocks

CACHES = ("k_cache", "v_cache", "pool")
OUTPUTS = {"decode": {"out": "[B, Hq, D] attention output in q's dtype"},
           "shared_prefix": {"out": "[B, Hq, D] attention output in q's dtype"},
           "write": {"k_cache": "the K plane after writing", "v_cache": "the V plane after writing"},
           "copy": {"pool": "the pool after copying"}}


def file_name(case: Case) -> str:
    """A file-system-safe name for a case (its id with ``/`` as ``__``)."""
    return re.sub(r"[^A-Za-z0-9_.=-]", "-", case.id.replace("/", "__").replace(",", "_"))


def _plane(t: torch.Tensor) -> torch.Tensor:
    return qblocks.plane_of(t) if t.dim() > 2 else t


def _view_of(plane: torch.Tensor, shape, stride) -> torch.Tensor:
    return plane.as_strided(tuple(shape), tuple(stride), plane.storage_offset())


def problem_tensors(case: Case, device="cpu") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of one problem file (see the module docstring)."""
    inputs = case.build(device)
    ref = inputs.pop("ref")
    tensors, views, scalars = {}, {}, {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            if k in CACHES:
                views[k] = {"shape": list(v.shape), "stride": list(v.stride()), "dtype": str(v.dtype)}
                tensors[k] = _plane(v).contiguous().cpu()
            elif k != "out":
                tensors[k] = v.contiguous().cpu()
        elif v is not None:
            scalars[k] = v
    if case.op == "write":
        kr, vr, kb, vb = ref
        tensors["ref.k_cache"], tensors["ref.v_cache"] = (qblocks.plane_of(r).contiguous().cpu() for r in (kr, vr))
        tensors["before.k_cache"], tensors["before.v_cache"] = kb.contiguous().cpu(), vb.contiguous().cpu()
    elif case.op == "copy":
        tensors["ref.pool"] = ref.contiguous().cpu()
    else:
        tensors["ref"] = ref.float().cpu()
    meta = {"case": case.id, "fields": json.dumps(case.as_dict()), "op": case.op, "scalars": json.dumps(scalars),
            "views": json.dumps(views), "outputs": json.dumps(OUTPUTS[case.op]),
            "tolerance": str(SUITE_FORMATS[case.kv_format].tol if case.op in ("decode", "shared_prefix") else 0.0)}
    return tensors, meta


def export_problems(cases, directory: Path | str, device="cpu") -> list[Path]:
    """Write each case as ``<directory>/<file_name(case)>.safetensors`` and a ``manifest.json`` listing them."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths, manifest = [], []
    for case in cases:
        tensors, meta = problem_tensors(case, device)
        path = out / f"{file_name(case)}.safetensors"
        save_file(tensors, str(path), metadata=meta)
        paths.append(path)
        manifest.append({"case": case.id, "file": path.name, "output": f"{file_name(case)}.out.safetensors",
                         "outputs": OUTPUTS[case.op]})
    (out / "manifest.json").write_text(json.dumps({"problems": manifest}, indent=1) + "\n")
    return paths


def describe_problems(directory: Path | str, problem: Path | str | None = None) -> str:
    """The files in ``directory`` with their sizes, then one problem file's case, tolerance and tensors (name,
    dtype, shape; default the first ``.safetensors`` by name)."""
    files = sorted(Path(directory).iterdir())
    lines = [f"{p.name:<62} {p.stat().st_size:>7} bytes" for p in files]
    problems = [p for p in files if p.name.endswith(".safetensors") and not p.name.endswith(".out.safetensors")]
    path = Path(problem) if problem is not None else (problems[0] if problems else None)
    if path is None:
        return "\n".join(lines)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        lines += ["", f"{path.name}: case {meta['case']}, tolerance {meta['tolerance']}"]
        lines += [f"  {key:<17} {f.get_slice(key).get_dtype():>4} {f.get_slice(key).get_shape()}" for key in f.keys()]
    return "\n".join(lines)


def load_problem(path: Path | str, device="cpu") -> tuple[Case, dict, object]:
    """``(case, inputs, ref)`` of a problem file: the inputs as the registry hands them out (caches as layout views
    over their planes, ``out`` a fresh NaN buffer), ``ref`` as :meth:`Case.build` gives it."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k).to(device) for k in f.keys()}  # noqa: SIM118  (safe_open has no __iter__)
    case = Case(**{**json.loads(meta["fields"]), "lens": tuple(json.loads(meta["fields"])["lens"])})
    views = json.loads(meta["views"])
    inputs: dict = dict(json.loads(meta["scalars"]))
    for k in ("k_scale", "v_scale", "quant"):
        inputs.setdefault(k, None)
    for k, t in tensors.items():
        if k != "ref" and not k.startswith(("ref.", "before.")):
            inputs[k] = _view_of(t, views[k]["shape"], views[k]["stride"]) if k in views else t
    if case.op == "write":
        ref = (*(_view_of(tensors[f"ref.{k}"], views[k]["shape"], views[k]["stride"]) for k in ("k_cache", "v_cache")),
               tensors["before.k_cache"], tensors["before.v_cache"])
    elif case.op == "copy":
        ref = tensors["ref.pool"]
    else:
        ref = tensors["ref"].double()
        inputs["out"] = torch.full_like(inputs["q"], float("nan"))
    return case, inputs, ref


def write_outputs(impl: str | Impl, directory: Path | str, device="cpu") -> list[Path]:
    """Run a registered implementation on every problem of ``directory`` and write its output files (what an outside
    program does; used to test the loop, and to export a peer's answers)."""
    directory = Path(directory)
    paths = []
    for entry in _manifest(directory):
        case, inputs, _ = load_problem(directory / entry["file"], device)
        impl_ = get(impl, case.op)
        got = impl_(dict(inputs))
        if case.op in ("decode", "shared_prefix"):
            tensors = {"out": (inputs["out"] if got is None else got).contiguous().cpu()}
        else:
            tensors = {k: _plane(inputs[k]).contiguous().cpu() for k in OUTPUTS[case.op]}
        path = directory / entry["output"]
        save_file(tensors, str(path))
        paths.append(path)
    return paths


def _manifest(directory: Path) -> list[dict]:
    path = directory / "manifest.json"
    if not path.is_file():
        raise ValueError(f"directory {directory} has no manifest.json: export problems there first")
    return json.loads(path.read_text())["problems"]


def judge_outputs(directory: Path | str, outputs: Path | str | None = None, name: str = "outside") -> Report:
    """Judge the output files (``outputs``, default ``directory``) of every problem in ``directory``."""
    directory = Path(directory)
    out_dir = Path(outputs) if outputs is not None else directory
    entries = _manifest(directory)
    report = Report(name, entries[0]["case"].split("/")[0] if entries else "decode", "outside (files)")
    for entry in entries:
        case, inputs, ref = load_problem(directory / entry["file"])
        tol = SUITE_FORMATS[case.kv_format].tol if case.op in ("decode", "shared_prefix") else 0.0
        path = out_dir / entry["output"]
        if not path.is_file():
            report.results.append(CaseResult(case, False, None, tol, f"no output file {path.name}"))
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                got = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            missing = sorted(set(OUTPUTS[case.op]) - set(got))
            if missing:
                raise ValueError(f"output file {path.name} lacks {missing}")
        except Exception as e:  # noqa: BLE001  (an unreadable output is a failed case)
            report.results.append(CaseResult(case, False, None, tol, f"unreadable output: {e}"))
            continue
        if case.op in ("decode", "shared_prefix"):
            err, why = judge_decode(got["out"], inputs, ref, tol)
        elif case.op == "write":
            views = {k: _view_of(got[k], inputs[k].shape, inputs[k].stride()) if got[k].shape ==
                     _plane(inputs[k]).shape else got[k] for k in ("k_cache", "v_cache")}
            err, why = judge_write(views, ref)
        else:
            err, why = judge_bytes(got["pool"], ref, "pool")
        report.results.append(CaseResult(case, not why, err, tol, why))
    return report
