"""Quantization-aware training with knowledge distillation from the float model (`algorithm=[...,qat]`), as
ExecuTorch's Qualcomm LLM example trains with `--qat` (quantize/qat.py, train/trainer.py KDTrainer, train/config/
qad.yaml: KL(teacher || student) with alpha 0.99, temperature 1, AdamW at 2e-5 with 5% warm-up and cosine decay,
gradient norm 1, the embedding and lm head frozen).

It is a model transform: the weights it returns are trained against the run's weight grid (qexp/qat/fake_quant.py)
and its scales go to the quantize stage as exact weight ranges, so the QDQ phase, the HTP and XNNPACK programs, the
caches, reports and `--compare` treat the trained model like any other algorithm's. It starts from the model the
earlier algorithms left (e.g. `algorithm=[rotation,weight_clip,gptq,qat]` trains from GPTQ's weights on weight_clip's
scales) and learns from the untransformed float model (the FP phase's), on the calibration half of the text only
(qexp/qat/data.py), validated on that half's last sequences; qexp/qat/loop.py trains.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from qexp.core.errors import ConfigError
from qexp.transforms.base import GridSearchTransform, TransformConfig, register_transform
from qexp.models.shapes import static_module_path
from qexp.quant.grid import grid_for, weight_layers

log = logging.getLogger("qexp")


@dataclass
class QatConfig(TransformConfig):
    tokens: int = 65536  # training tokens (whole sequences) from the calibration half
    seq_len: Optional[int] = None  # training sequence length; null: export.max_context_len
    grad_accum: int = 4  # sequences per optimizer step (the static llama runs one sequence at a time)
    lr: float = 2.0e-5
    warmup: float = 0.05  # fraction of the steps with a linear warm-up, then cosine decay to 0
    alpha: float = 0.99  # weight of the KD loss; 1 - alpha weighs cross-entropy on the text
    temperature: float = 1.0
    max_grad_norm: float = 1.0
    weight_decay: float = 0.01
    # parameters (the static llama's names, regex search) that do not train: upstream's SmolLM2 QAT recipe freezes
    # the token embedding and the lm head
    frozen: List[str] = field(default_factory=lambda: ["tok_embeddings", r"^output\."])
    learn_scales: bool = False  # per-channel weight scales train too (LSQ gradient); false: fixed at the start
    scale_lr: Optional[float] = None  # the learned scales' peak learning rate (same schedule); null: lr
    validation_sequences: int = 8  # the calibration half's last sequences, for validation and early stopping
    validations: int = 8  # how many times training validates (and checkpoints)
    patience: int = 0  # validations without improvement before stopping early (0: train every step)
    seed: int = 0  # order of the training sequences
    device: str = "auto"  # auto: CUDA when present, else CPU


@register_transform
class Qat(GridSearchTransform):
    name = "qat"
    # 2: the weights fake-quantized once per optimizer step (gradients summed before the rounding's); 3: the trained
    # weights written back rounded onto their grid (fake_quant.detach)
    version = 3
    follows_run_device = False  # trains on algorithm.qat.device (in its settings, so in its fingerprint)
    config_class = QatConfig
    sets_weight_ranges = True  # the scales it trained against, exactly
    uses_weight_ranges = True  # starts from an earlier weight_clip's or GPTQ's scales
    needs_grid_because = "trains against a quantization grid"

    def validate(self, cfg) -> None:
        super().validate(cfg)
        c = self.config
        checks = [
            (c.lr > 0, f"lr={c.lr}", "use a learning rate > 0, e.g. algorithm.qat.lr=2e-5"),
            (c.tokens > 0, f"tokens={c.tokens}", "use a token budget > 0"),
            (c.grad_accum >= 1, f"grad_accum={c.grad_accum}", "use grad_accum >= 1"),
            (0 <= c.alpha <= 1, f"alpha={c.alpha}", "use 0 <= alpha <= 1"),
            (c.temperature > 0, f"temperature={c.temperature}", "use a temperature > 0"),
            (0 <= c.warmup < 1, f"warmup={c.warmup}", "use 0 <= warmup < 1"),
            (c.validation_sequences >= 1 and c.validations >= 1,
             f"validation_sequences={c.validation_sequences} validations={c.validations}", "use values >= 1"),
            (c.seq_len is None or c.seq_len >= 2, f"seq_len={c.seq_len}", "use seq_len >= 2 or null"),
            (c.device in ("auto", "cpu", "cuda"), f"device={c.device!r}", "use auto, cpu or cuda"),
            (c.scale_lr is None or c.scale_lr > 0, f"scale_lr={c.scale_lr}", "use a scale learning rate > 0 or null"),
            (c.scale_lr is None or c.learn_scales, f"scale_lr={c.scale_lr} without learn_scales=true",
             "set algorithm.qat.learn_scales=true, or leave scale_lr null"),
        ]
        for ok, what, fix in checks:
            if not ok:
                raise ConfigError(f"algorithm.qat.{what}", fix)
        if c.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("algorithm.qat.device=cuda, and torch sees no CUDA device", "use device=auto or cpu")
        if c.learn_scales and _has_block_grid(cfg.quant):
            raise ConfigError("algorithm.qat.learn_scales=true with a per-block (LPBQ) grid: HTP stores block scales "
                              "as 4-bit multiples of a per-channel unit, which a gradient cannot move",
                              "use learn_scales=false, or a per-channel scheme (quant=16a4w)")
        seq_len = self.seq_len(cfg)
        if seq_len > cfg.export.max_context_len and c.seq_len is not None:
            raise ConfigError(f"algorithm.qat.seq_len={seq_len} is longer than export.max_context_len="
                              f"{cfg.export.max_context_len}", "lower algorithm.qat.seq_len")
        for pattern in c.frozen:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"algorithm.qat.frozen: {pattern!r} is not a regex ({exc})", "fix the pattern")

    def seq_len(self, cfg) -> int:
        return int(self.config.seq_len or cfg.export.max_context_len)

    def device(self) -> torch.device:
        from qexp.core.device import resolved_name

        return torch.device(resolved_name(self.config.device))

    def grid_dependency(self, cfg) -> Dict[str, Any]:
        """Besides the grid: the text it trains on (the calibration half of `calibration.text` or the evaluation
        text), the training length, and the device when it is not the CPU (CUDA's kernels round differently)."""
        from omegaconf import OmegaConf

        text = OmegaConf.to_container(cfg.text, resolve=True, enum_to_str=True)
        calibration_text = cfg.calibration.get("text")
        training = getattr(calibration_text, "value", calibration_text) or text["source"]
        if training != text["source"]:  # trained on another text's calibration half: that text, whatever is scored
            text.update(name=training, source=training)
        # "calibration_text" is always None: `text` names the training text alone, so a model trained on wikitext and
        # scored on news (text=news calibration.text=wikitext) is the one a wikitext run trained
        dependency = {**super().grid_dependency(cfg), "seq_len": self.seq_len(cfg), "text": text,
                      "calibration_text": "None"}
        if self.device().type != "cpu":
            dependency["device"] = self.device().type
        return dependency

    def fingerprint(self) -> Dict[str, Any]:
        fingerprint = super().fingerprint()
        fingerprint["config"].pop("device", None)  # where it trains enters through grid_dependency, resolved
        return fingerprint

    def training_text(self, cfg, model, cache):
        """The sequences it trains and validates on: the calibration half of the training text."""
        from qexp.data.text import calibration_corpus, load_corpus
        from qexp.qat.data import training_text

        c = self.config
        corpus = calibration_corpus(cfg.text, cfg.calibration.get("text"), load_corpus(cfg.text, cache), cache)
        return training_text(corpus.joined("calibration"), f"{corpus.source}:calibration", model.tokenizer,
                             model.add_bos, self.seq_len(cfg), c.tokens, c.validation_sequences, c.seed)

    def fitted_rows(self, cfg, model, cache):
        text = self.training_text(cfg, model, cache)
        rows = list(text.train.numpy()) + list(text.validation.numpy())
        return rows, f"QAT's training sequence {{index}} (of {text.source}; training first, then validation)"

    def apply(self, model, context):
        from qexp.models.static_llama import StaticLlama
        from qexp.qat.fake_quant import attach, detach, quantized_once
        from qexp.qat.loop import LoopSettings, train

        cfg, c = context.cfg, self.config
        seq_len = self.seq_len(cfg)
        text = self.training_text(cfg, model, context.cache)
        student = StaticLlama.private_copy(model, seq_len, cfg.model)
        teacher = context.reference_static  # the FP phase's static llama: one float copy less in memory
        if teacher is None or teacher.ar_len != seq_len or context.reference is None:
            teacher = StaticLlama.for_model_config(context.reference or model, seq_len, cfg.model)
        for p in teacher.module.parameters():
            p.requires_grad_(False)
        grids, scales, keys = _starting_grids(cfg, model, student)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict.items()}
        frozen = [re.compile(p) for p in c.frozen]
        for name, param in student.module.named_parameters():
            param.requires_grad_(not any(p.search(name) for p in frozen))
        attach(student.module, grids, scales, c.learn_scales)
        device = self.device()
        steps = -(-len(text.train) // c.grad_accum)
        settings = LoopSettings(steps=steps, grad_accum=c.grad_accum, lr=c.lr, warmup=c.warmup, alpha=c.alpha,
                                temperature=c.temperature, max_grad_norm=c.max_grad_norm,
                                weight_decay=c.weight_decay, eval_every=max(1, -(-steps // c.validations)),
                                patience=c.patience, device=device, scale_lr=c.scale_lr)
        n_train = sum(p.numel() for p in student.module.parameters() if p.requires_grad)
        log.info("QAT: %d steps of %d x %d tokens (%d tokens of %s, %d validation sequences), %d parameters train, "
                 "on %s", steps, c.grad_accum, seq_len, steps * c.grad_accum * seq_len, text.source,
                 len(text.validation), n_train, device)
        train_ids = _padded(text.train, steps * c.grad_accum)

        def forward(module, ids):
            inputs = [t.to(device) for t in student.inputs(ids)]
            out = module(*inputs)
            logits = out[0] if isinstance(out, (tuple, list)) else out
            return logits.reshape(seq_len, -1)[: len(ids)].float()

        checkpoint = context.cache.root / "qat-checkpoints" / f"{context.key}.pt" if context.key else None
        progress = context.progress
        history = train(student.module, teacher.module, forward, train_ids, text.validation, settings, checkpoint,
                        step_context=lambda grad: quantized_once(student.module, list(grids), grad),
                        on_validation=None if progress is None else (lambda history: progress(_curves(history))))
        final_scales, clamped = detach(student.module, list(grids))
        params = dict(student.module.named_parameters())
        linears = set(weight_layers(shapes))
        state, ranges = dict(model.state_dict), dict(model.weight_ranges)
        for key in model.state_dict:  # the trained tensors back in Meta layout; frozen ones stay the input's
            name = f"{static_module_path(key)}.weight" if key in linears else key
            if name in params and params[name].requires_grad:
                value = params[name].detach()
                state[key] = student.meta_layout(key, value).contiguous() if key in linears else value.clone()
        for path, key in keys.items():
            ranges[key] = student.meta_layout(key, final_scales[path]) * grids[path].qmax
        context.outputs[self.name] = _outputs(history, text, settings, n_train)
        context.outputs[self.name]["metrics"]["qat_latent_clamped_fraction"] = clamped
        if checkpoint is not None:
            checkpoint.unlink(missing_ok=True)
        return dataclasses.replace(model, state_dict=state, weight_ranges=ranges)


def _has_block_grid(quant) -> bool:
    from qexp.core.config import Granularity

    return quant.weight_granularity == Granularity.per_block or any(
        o.granularity == Granularity.per_block for o in quant.overrides)


def _padded(train_ids: torch.Tensor, n: int) -> torch.Tensor:
    """`n` sequences: the last step's batch filled from the start of the order (whole steps only)."""
    if len(train_ids) >= n:
        return train_ids[:n]
    return torch.cat([train_ids, train_ids[: n - len(train_ids)]])


def _curves(history) -> dict:
    """The loss curves by step: {metric name: [(step, value), ...]}."""
    return {"qat_train_kd": [(r["step"], r["kd"]) for r in history.train],
            "qat_train_ce": [(r["step"], r["ce"]) for r in history.train],
            "qat_lr": [(r["step"], r["lr"]) for r in history.train],
            "qat_val_kd": [(r["step"], r["kd"]) for r in history.validation],
            "qat_val_ce": [(r["step"], r["ce"]) for r in history.validation]}


def _starting_grids(cfg, model, student) -> tuple:
    """Per quantized linear (by its static module path): its weight grid, its starting scales (the ranges an earlier
    algorithm chose, else the grid's own) and its Meta-layout key."""
    grids, scales, keys = {}, {}, {}
    for key in weight_layers({k: tuple(v.shape) for k, v in model.state_dict.items()}):
        grid = grid_for(cfg.quant, key)
        if grid is None or grid.bits >= 16:
            continue
        path = static_module_path(key)
        _, weight = student.static_layout(key, model.state_dict[key])
        if key in model.weight_ranges:
            _, ranges = student.static_layout(key, model.weight_ranges[key])
            scales[path] = ranges / grid.qmax
        else:
            scales[path] = grid.scales(weight)
        grids[path], keys[path] = grid, key
    return grids, scales, keys


def _outputs(history, text, settings, n_train: int) -> dict:
    """What the run logs about the training (also when the result comes from the cache): loss curves by step, the
    training text as a dataset, and summary metrics."""
    first, best = history.validation[0], next(r for r in history.validation if r["step"] == history.best_step)
    metrics = {"qat_steps": settings.steps, "qat_steps_trained": history.train[-1]["step"] if history.train else 0,
               "qat_train_tokens": text.train_tokens, "qat_best_step": history.best_step,
               "qat_val_kd_start": first["kd"], "qat_val_kd_best": best["kd"],
               "qat_val_ce_start": first["ce"], "qat_val_ce_best": best["ce"],
               "qat_train_minutes": history.seconds / 60, "qat_resumed_from_step": history.resumed_from,
               "qat_trained_parameters": n_train}
    return {"metric_history": _curves(history), "metrics": metrics,
            "tags": {"qat_device": str(settings.device), "qat_stopped_early": str(history.stopped_early).lower()},
            "dataset": {"ids": torch.cat([text.train, text.validation]), "name": text.source,
                        "digest": text.sha256, "context": "training",
                        "tags": {"train_sequences": len(text.train), "validation_sequences": len(text.validation),
                                 "seq_len": text.train.shape[1]}}}
