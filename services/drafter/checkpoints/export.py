"""Export a trained drafter in the layout of the released z-lab DFlash drafters.

    <out>/config.json          Qwen3 layer fields + architectures ["DFlashDraftModel"], block_size,
                               num_target_layers, dflash_config {target_layer_ids, mask_token_id}
    <out>/model.safetensors    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
                               layers.{i}.mlp.{gate,up,down}_proj.weight,
                               layers.{i}.{input,post_attention}_layernorm.weight,
                               fc.weight, hidden_norm.weight, norm.weight        (no embedding, no lm_head)
                               and, for a Domino drafter, prefix_gru.weight_{ih,hh}_l0, embed_proj.{0,2}.weight
    <out>/export.json          which step it holds, whether that is the run's last and/or best
                               (held-out τ) step, block_size and vLLM's num_speculative_tokens
Every file gets the mode of a new file (0644 under the usual umask), so an engine running under
another account can read the export (safetensors alone would write the weights 0600).

What the public loaders read (checked against z-lab/dflash `dflash/model.py`, SGLang
`srt/models/dflash.py` + `speculative/dflash_utils.py`, vLLM `models/qwen3_dflash.py`):
- architectures ["DFlashDraftModel"] selects the model class in SGLang and vLLM; model_type "qwen3"
  lets transformers' AutoConfig parse the file.
- target_layer_ids and mask_token_id: from dflash_config (all three), with top-level fallbacks.
  vLLM adds 1 to the ids itself (its "aux hidden state" numbering); we store DFlash's numbering.
  The engines concatenate the features in the listed order; the target captures them in ascending
  order, the only order the config takes, so the ids are written as the checkpoint lists them.
- vLLM takes the block from num_speculative_tokens, which must be block_size - 1 (the anchor plus
  B - 1 mask slots); SGLang reads block_size from config.json. export.json and the command's
  output carry the value, and the serving commands for the run's own target (export.json `serve`):
  SGLang needs --mamba-scheduler-strategy extra_buffer for a Qwen3.5/3.6 hybrid target (Gated
  DeltaNet layers), vLLM VLLM_USE_V2_MODEL_RUNNER=1 for a drafter that mixes sliding and full layers.
- block_size: top level (released drafters) or dflash_config; num_target_layers: top level.
- layer_types, sliding_window, use_sliding_window: the drafter's layout (docs/dflash.md "Sliding-window
  layers"). vLLM (`_resolve_layer_attention`) gives layer i the top-level sliding_window when
  layer_types[i] is "sliding_attention"; transformers' Qwen3Config keeps sliding_window only when
  use_sliding_window is true, so it is true exactly when some layer slides. sliding_window is null
  for an all-full drafter. Mixed layouts need vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1).
- is_causal false, written explicitly: every draft layer is non-causal inside its block, as trained.
  Unset, vLLM (`_dflash_layer_causal`) and SpecForge (`resolve_dflash_is_causal`, "the way SGLang's
  DFlash model does") would make the sliding layers causal.
- Tensor names without a "model." prefix: SGLang resolves either, vLLM prepends "model.".
- auto_map is left out: it names a remote-code file (dflash.py) that only z-lab's repos ship. For
  transformers' AutoModel(trust_remote_code=True), copy that file next to config.json and add
  "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}. SGLang and vLLM do not need it.

Weights are written in bf16 by default, as the released drafters are (`"dtype": "bfloat16"`): the
engines serve in bf16, and it halves the files. Training keeps fp32 master weights in the
checkpoints; `--dtype float32` exports those unrounded.

    python -m services.drafter.checkpoints.export --checkpoint runs/x/checkpoints/latest --out runs/x/export
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

import torch

from services.drafter.modeling.model import DrafterModelConfig
from services.run import dtypes
from services.run.shapes import ARCHITECTURE

DTYPES = dtypes.EXPORT
EXPORT_RECORD = "export.json"


class ExportError(Exception):
    pass


def num_speculative_tokens(block_size: int) -> int:
    """vLLM's setting for a DFlash drafter: the tokens drafted per step, the block minus its anchor."""
    return block_size - 1


def hybrid_target(model_path: str | None) -> bool:
    """Whether the target is a Qwen3.5/3.6 hybrid (Gated DeltaNet layers): its config.json (or text_config)
    lists linear_attention layers or has a qwen3_5* model_type. SGLang serves those with DFlash only
    with --mamba-scheduler-strategy extra_buffer. False when the folder cannot be read."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False
    if not isinstance(config, dict):
        return False
    for section in (config, config.get("text_config") or {}):
        if "linear_attention" in (section.get("layer_types") or ()) or str(section.get("model_type", "")).startswith(
            "qwen3_5"
        ):
            return True
    return False


def mixed_layers(m: DrafterModelConfig) -> bool:
    """Sliding-window and full layers in one drafter: vLLM serves that with its V2 model runner only."""
    return len(set(m.layer_types)) > 1


def serve_commands(out: Path, m: DrafterModelConfig, target: str | None) -> dict:
    """The vLLM and SGLang commands that serve this export with its target, quoted to paste into a
    shell. target: the target's model folder (the run's target.model_path); None: unknown (an export
    of a checkpoint outside its run), then the commands say <target>."""
    if target and Path(target).exists():
        target = str(Path(target).resolve())  # a relative folder: as pasted anywhere
    model = shlex.quote(target) if target else "<target>"
    spec = json.dumps(
        {"method": "dflash", "model": str(out), "num_speculative_tokens": num_speculative_tokens(m.block_size)}
    )
    vllm = f"vllm serve {model} --speculative-config {shlex.quote(spec)}"
    if mixed_layers(m):
        vllm = "VLLM_USE_V2_MODEL_RUNNER=1 " + vllm
    sglang = (
        f"python -m sglang.launch_server --model-path {model} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {shlex.quote(str(out))}"
    )
    if target and hybrid_target(target):
        sglang += " --mamba-scheduler-strategy extra_buffer"
    serve = {"target": target or None, "vllm": vllm, "sglang": sglang}
    if m.domino:
        serve["note"] = (
            "a Domino drafter: its correction head runs where the engine supports Domino (SGLang's DFlash "
            "worker reads dflash_config.projector_type); an engine that does not drafts with the backbone alone, "
            "at lower acceptance (docs/guide/drafter.md, Domino)"
        )
    return serve


def serve_hints(serve: dict, block_size: int) -> str:
    """How to serve the export (printed with it), as export.json's `serve` has it."""
    lines = [
        f"vLLM:   {serve['vllm']}",
        f"SGLang: {serve['sglang']}",
        f"(vLLM's num_speculative_tokens is block_size - 1 = {num_speculative_tokens(block_size)}; "
        f"SGLang reads block_size {block_size} from config.json)",
    ]
    if not serve.get("target"):
        lines.append("replace <target> with the folder of the target the drafter was trained on")
    if serve.get("note"):
        lines.append(serve["note"])
    return "\n".join(lines)


def run_target(checkpoint: Path) -> str | None:
    """target.model_path of the run a checkpoint lies in (<run>/checkpoints/<step>), from its config.json."""
    for run_dir in (checkpoint.parent.parent, checkpoint.parent):
        try:
            return json.loads((run_dir / "config.json").read_text())["target"]["model_path"] or None
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def expected_tensor_names(m: DrafterModelConfig) -> list[str]:
    per_layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    if m.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkvo"]
    names = [f"layers.{i}.{n}" for i in range(m.num_hidden_layers) for n in per_layer]
    if m.domino:  # Domino's correction head (services/drafter/modeling/domino.py), named as SpecForge's
        names += ["prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"]
    return sorted(names + ["fc.weight", "hidden_norm.weight", "norm.weight"])


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move tmp to out; an existing out must be an earlier export (never someone's other folder)."""
    if out.exists():
        try:
            ours = ARCHITECTURE in json.loads((out / "config.json").read_text()).get("architectures", [])
        except (OSError, ValueError, AttributeError):
            ours = False
        if any(out.iterdir()) and not ours:
            raise ExportError(f"refusing to replace {out}: it is not empty and not a DFlash export")
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def export_weights(
    weights: dict[str, torch.Tensor],
    model_cfg: DrafterModelConfig,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    provenance: dict | None = None,
    target: str | None = None,
) -> Path:
    """Write config.json, model.safetensors and export.json into out_dir (atomically: a temp dir,
    then rename). provenance: step, last, best, ... (see export_record), recorded in export.json
    and in the safetensors metadata. target: the run's target.model_path, for the serving commands
    export.json keeps (`serve`: target, vllm, sglang)."""
    from safetensors.torch import save_file

    from services.run.files import default_file_mode

    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    names = expected_tensor_names(model_cfg)
    if sorted(weights) != names:
        extra, missing = sorted(set(weights) - set(names)), sorted(set(names) - set(weights))
        raise ExportError(f"drafter weights do not match the DFlash layout: unexpected {extra}, missing {missing}")
    from services.drafter.checkpoints.checkpoint import nonfinite_tensors

    if bad := nonfinite_tensors(weights):
        raise ExportError(
            f"export not written: non-finite values in {len(bad)} weight tensor(s), e.g. {', '.join(bad[:3])}"
        )
    out = Path(out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tensors = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in weights.items()}
        record = {
            **(provenance or {}),
            "block_size": model_cfg.block_size,
            "dtype": dtype,
            "num_speculative_tokens": num_speculative_tokens(model_cfg.block_size),
            "target_layer_ids": list(model_cfg.target_layer_ids),
            "serve": serve_commands(out, model_cfg, target),
        }
        metadata = {"format": "pt", **{k: json.dumps(v) for k, v in record.items()}}
        save_file(tensors, str(tmp / "model.safetensors"), metadata=metadata)
        default_file_mode(tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(model_cfg.to_hf(dtype), indent=2, sort_keys=True) + "\n")
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint dir, or a run dir / checkpoints dir (then its `latest`)."""
    path = Path(path)
    for candidate in (path, path / "latest", path / "checkpoints" / "latest"):
        if (candidate / "manifest.json").is_file():
            return candidate.resolve()
    if path.name == "best" and not path.exists():
        latest = path.with_name("latest")
        raise ExportError(
            f"{path} does not exist: `best` is the checkpoint with the best held-out τ, and only runs "
            f"that evaluate (eval.every > 0) have one; export {latest} instead"
        )
    raise ExportError(f"{path}: not a checkpoint (no manifest.json), and no checkpoints/latest under it")


def export_record(
    step: int,
    *,
    last: bool,
    best: bool,
    best_step: int | None,
    checkpoint: str | None = None,
    eval_tau: float | None = None,
) -> dict:
    """What export.json says about the weights: their step, and whether that step is the run's last
    and/or its best (highest held-out τ; best_step is None when the run never evaluated)."""
    return {
        "step": step,
        "last": last,
        "best": best,
        "best_step": best_step,
        "checkpoint": checkpoint,
        "eval_tau": eval_tau,
    }


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    from safetensors.torch import load_file

    from services.drafter.checkpoints.checkpoint import BEST, LATEST, CorruptCheckpoint, pointer, step_of, verify

    path = resolve_checkpoint(checkpoint)
    try:
        meta = verify(path)
    except CorruptCheckpoint as exc:
        raise ExportError(f"checkpoint {path} is corrupt: {exc}") from None
    model_cfg = DrafterModelConfig(**meta["model"])
    if model_cfg.target_layer_ids != sorted(model_cfg.target_layer_ids):
        raise ExportError(
            f"checkpoint {path} lists target_layer_ids {model_cfg.target_layer_ids} out of order: "
            "a checkpoint this version does not export"
        )
    weights = load_file(str(path / "model.safetensors"))
    latest, best = pointer(path.parent, LATEST), pointer(path.parent, BEST)
    provenance = export_record(
        int(meta["step"]),
        last=latest is not None and latest.resolve() == path,
        best=best is not None and best.resolve() == path,
        best_step=step_of(best) if best else None,
        checkpoint=path.name,
        eval_tau=(meta.get("eval") or {}).get("tau"),
    )
    return export_weights(weights, model_cfg, out_dir, dtype, provenance, target=run_target(path))


def describe_export(out: Path, checkpoint: Path, record: dict) -> str:
    """The first line `launcher export` prints: what was written, from which step, in words."""
    which = " and ".join(w for w in ("last", "best") if record.get(w)) or "neither the last nor the best"
    return (
        f"exported step {record['step']} ({which} of its run) from {checkpoint} to {out}: "
        f"block_size {record['block_size']}, {record['dtype']} weights; export.json has these commands"
    )


def main(argv=None) -> int:
    from services.process import torchao_gate

    torchao_gate.hide()  # transformers would import it (and print its warnings) for nothing here
    p = argparse.ArgumentParser(
        prog="python -m services.drafter.checkpoints.export",
        description="Export a drafter checkpoint as an HF-style DFlash drafter dir.",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint dir, or a run dir (uses checkpoints/latest)")
    p.add_argument("--out", required=True, help="output dir (created; an earlier export there is replaced)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, args.dtype)
    except ExportError as exc:
        print(f"export: error: {exc}", file=sys.stderr)
        return 2
    record = json.loads((out / EXPORT_RECORD).read_text())
    print(describe_export(out, resolve_checkpoint(args.checkpoint), record))
    print(serve_hints(record["serve"], record["block_size"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
