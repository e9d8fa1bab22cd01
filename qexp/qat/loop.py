"""The QAT training loop: distillation from the float model (KL at a temperature, plus cross-entropy on the text's
next tokens), AdamW with linear warm-up and cosine decay, gradient accumulation and clipping, validation on a held-out
slice of the calibration half, early stopping on it (the best validated weights are kept, the starting point
included), and a checkpoint after every validation so a killed run resumes where it stopped.

The losses and the schedule are upstream's (ExecuTorch's Qualcomm LLM example, `train/loss.py`, `train/utils.py`:
what its `--qat` trains with); the loop is written here because upstream's (`train/trainer.py` BaseTrainer) runs on
CPU only, validates once per epoch, reports to the logger only and cannot resume.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Dict, List, Optional

import torch
from executorch.examples.qualcomm.oss_scripts.llama.dataset.constants import LABEL_IGNORE_INDEX
from executorch.examples.qualcomm.oss_scripts.llama.train.loss import CrossEntropyLoss, KLDivergenceLoss
from executorch.examples.qualcomm.oss_scripts.llama.train.utils import get_warmup_cosine_lr
from torch import nn
from tqdm import tqdm

log = logging.getLogger("qexp")

CHECKPOINT_VERSION = 2  # 2: the best weights in their own file, named by step


@dataclass
class LoopSettings:
    steps: int  # optimizer steps
    grad_accum: int  # sequences per step
    lr: float
    warmup: float  # fraction of the steps
    alpha: float  # KD weight; 1 - alpha weighs cross-entropy
    temperature: float
    max_grad_norm: float
    weight_decay: float
    eval_every: int  # steps between validations
    patience: int  # validations without improvement before stopping (0: never stop early)
    device: torch.device
    scale_lr: Optional[float] = None  # the learned scales' peak rate (None: lr)


@dataclass
class History:
    train: List[dict] = field(default_factory=list)  # per step: step, kd, ce, lr
    validation: List[dict] = field(default_factory=list)  # per validation: step, kd, ce, loss
    best_step: int = 0
    stopped_early: bool = False
    resumed_from: int = 0  # the step a checkpoint resumed training at (0: trained from the start)
    seconds: float = 0.0  # training time of this process (a resumed run counts its own part)


def next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    """Labels for upstream's losses: position t predicts token t+1; the last position has none."""
    return torch.cat([ids[1:], torch.tensor([LABEL_IGNORE_INDEX], dtype=ids.dtype)])


StepContext = Callable[[bool], ContextManager]


def train(student: nn.Module, teacher: nn.Module, forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
          train_ids: torch.Tensor, validation_ids: torch.Tensor, settings: LoopSettings,
          checkpoint: Optional[Path] = None, step_context: Optional[StepContext] = None,
          on_validation: Optional[Callable[[History], None]] = None) -> History:
    """Train `student`'s parameters that require grad in place. `forward(module, ids [T])` returns logits [T, V] on
    `settings.device`. `step_context(grad)` wraps each optimizer step's micro-batches (grad=True) and each validation
    (grad=False), within which the student's weights do not change (qexp/qat/fake_quant.py `quantized_once`).
    `on_validation(history)` is called after each validation, the starting point's included (a tracked run logs the
    curves so far: a long training can be watched in the UI). On return the student holds the best validated
    weights."""
    report = on_validation or (lambda history: None)
    run = _Training(student, teacher, forward, validation_ids, settings, checkpoint, step_context)
    start = run.resume()
    report(run.history)
    started = time.time()
    bar = tqdm(range(start, settings.steps), desc="qat", unit="step", leave=False, initial=start,
               total=settings.steps)
    for step in bar:
        row = run.step(step, train_ids)
        bar.set_postfix(kd=f"{row['kd']:.4f}", ce=f"{row['ce']:.3f}")
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            stop = run.validate_and_stop(row)
            report(run.history)
            if stop:
                break
    bar.close()
    history, best = run.history, run.best
    history.seconds = time.time() - started
    log.info("QAT: trained %d steps in %.1f min; kept step %d (validation loss %.4f, at the start %.4f)",
             len(history.train) - start, history.seconds / 60, best["step"], best["loss"],
             history.validation[0]["loss"])
    history.best_step = best["step"]
    _load_trainable(run.trainable, torch.load(run.best_file(best["step"]), weights_only=True, map_location="cpu"))
    run.remove_best_files()
    student.to("cpu")
    teacher.to("cpu")
    return history


class _Training:
    """One training run's state: the optimizer and schedule, the history, the best validated weights (on disk, beside
    the checkpoint: a model-sized copy less in memory)."""

    def __init__(self, student, teacher, forward, validation_ids, settings: LoopSettings, checkpoint, step_context):
        self.student, self.teacher, self.forward, self.settings = student, teacher, forward, settings
        self.checkpoint = checkpoint
        self.step_context = step_context or (lambda grad: nullcontext())
        if checkpoint is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="qexp-qat-")
            self.best_stem = Path(self._scratch.name) / "qat"
        else:
            self.best_stem = checkpoint.parent / "best" / checkpoint.stem
        self.trainable = {n: p for n, p in student.named_parameters() if p.requires_grad}
        if not self.trainable:
            raise ValueError("QAT has nothing to train: every parameter is frozen")
        student.to(settings.device)
        teacher.to(settings.device).eval()
        decay = [p for n, p in self.trainable.items() if not n.endswith(".scales")]
        no_decay = [p for n, p in self.trainable.items() if n.endswith(".scales")]
        # AdamW moves a parameter by about the rate a step whatever its gradient's size, so scales (a few 1e-3) need
        # their own, smaller rate; the schedule scales every group's rate alike
        scale_group = {"params": no_decay, "weight_decay": 0.0, "lr": settings.scale_lr or settings.lr}
        groups = [{"params": decay}] + ([scale_group] if no_decay else [])
        self.optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.999), eps=1e-8,
                                           weight_decay=settings.weight_decay)
        warmup_steps = max(1, int(settings.steps * settings.warmup))
        self.scheduler = get_warmup_cosine_lr(self.optimizer, warmup_min_lr=min(1e-8, settings.lr),
                                              warmup_max_lr=settings.lr, warmup_num_steps=warmup_steps,
                                              total_steps=settings.steps)
        self.kd_loss, self.ce_loss = KLDivergenceLoss(settings.temperature), CrossEntropyLoss()
        self.validation_ids = validation_ids
        self.history = History()
        self.best = {"loss": math.inf, "step": None}
        self.bad_validations = 0

    def losses(self, ids: torch.Tensor, target: Optional[torch.Tensor] = None):
        labels = next_token_labels(ids).to(self.settings.device)[None]
        if target is None:
            with torch.no_grad():
                target = self.forward(self.teacher, ids)
        logits = self.forward(self.student, ids)[None]
        return self.kd_loss.compute(logits, target[None], labels), self.ce_loss.compute(logits, labels)

    @torch.no_grad()
    def validate(self, step: int) -> dict:
        """The validation losses; the teacher's logits are recomputed each time rather than held (vocabulary-sized
        rows for every validation token: as much memory as the model's weights)."""
        kd = ce = 0.0
        with self.step_context(False):
            pairs = [self.losses(ids) for ids in self.validation_ids]
        for k, c in pairs:
            kd, ce = kd + k.item(), ce + c.item()
        n = max(len(self.validation_ids), 1)
        row = {"step": step, "kd": kd / n, "ce": ce / n}
        row["loss"] = self.settings.alpha * row["kd"] + (1 - self.settings.alpha) * row["ce"]
        return row

    def resume(self) -> int:
        """The step training starts at: a matching checkpoint's, else 0 (after validating the starting point)."""
        settings, checkpoint = self.settings, self.checkpoint
        if checkpoint is not None and checkpoint.exists():
            saved = torch.load(checkpoint, weights_only=True, map_location="cpu")
            if saved.get("version") == CHECKPOINT_VERSION and saved.get("steps") == settings.steps:
                _load_trainable(self.trainable, saved["trainable"])
                self.optimizer.load_state_dict(saved["optimizer"])
                self.scheduler.load_state_dict(saved["scheduler"])
                self.history, self.best = History(**saved["history"]), saved["best"]
                self.bad_validations, start = saved["bad"], saved["step"]
                self.history.resumed_from = start
                log.info("QAT: resuming at step %d of %d from the checkpoint %s", start, settings.steps, checkpoint)
                return start
            log.info("QAT: the checkpoint %s is from other settings; training from the start", checkpoint)
        row = self.validate(0)  # the starting point (the PTQ program's weights) competes with every trained state
        self.history.validation.append(row)
        self.keep_best(row)
        log.info("QAT start: validation kd %.4f ce %.3f", row["kd"], row["ce"])
        return 0

    def step(self, step: int, train_ids: torch.Tensor) -> dict:
        settings = self.settings
        self.optimizer.zero_grad(set_to_none=True)
        kd_sum = ce_sum = 0.0
        with self.step_context(True):
            for micro in range(settings.grad_accum):
                kd, ce = self.losses(train_ids[step * settings.grad_accum + micro])
                loss = settings.alpha * kd + (1 - settings.alpha) * ce
                (loss / settings.grad_accum).backward()
                kd_sum, ce_sum = kd_sum + kd.item(), ce_sum + ce.item()
        if settings.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(list(self.trainable.values()), settings.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        row = {"step": step + 1, "kd": kd_sum / settings.grad_accum, "ce": ce_sum / settings.grad_accum,
               "lr": self.scheduler.get_last_lr()[0]}
        self.history.train.append(row)
        return row

    def validate_and_stop(self, row: dict) -> bool:
        """Validate after the step `row` records, keep the best weights, checkpoint; True: stop early."""
        settings, step = self.settings, row["step"]
        val = self.validate(step)
        self.history.validation.append(val)
        if val["loss"] < self.best["loss"]:
            self.keep_best(val)
            self.bad_validations = 0
        else:
            self.bad_validations += 1
        log.info("QAT step %d/%d: train kd %.4f ce %.3f | validation kd %.4f ce %.3f (best at step %d)",
                 step, settings.steps, row["kd"], row["ce"], val["kd"], val["ce"], self.best["step"])
        stop = bool(settings.patience and self.bad_validations >= settings.patience)
        if self.checkpoint is not None and step < settings.steps and not stop:
            _save_checkpoint(self.checkpoint, {
                "version": CHECKPOINT_VERSION, "steps": settings.steps, "step": step,
                # serialized at once: the tensors themselves (on the CPU), not a copy
                "trainable": {n: p.detach().cpu() for n, p in self.trainable.items()},
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "history": dataclasses.asdict(self.history), "best": self.best, "bad": self.bad_validations})
            self.remove_best_files(keep=self.best["step"])  # the checkpoint now names this one
        if stop:
            self.history.stopped_early = True
            log.info("QAT: validation loss has not improved for %d validations: stopped at step %d",
                     settings.patience, step)
        return stop


    def best_file(self, step: int) -> Path:
        """The best validated weights of `step`; named by step so that a checkpoint and the file it names always
        agree, whatever instant a run is killed at."""
        return self.best_stem.with_name(f"{self.best_stem.name}.best-{step}.pt")

    def keep_best(self, row: dict) -> None:
        _save_checkpoint(self.best_file(row["step"]), {n: p.detach().cpu() for n, p in self.trainable.items()})
        self.best = {"loss": row["loss"], "step": row["step"]}

    def remove_best_files(self, keep: Optional[int] = None) -> None:
        for path in self.best_stem.parent.glob(f"{self.best_stem.name}.best-*.pt"):
            if keep is None or path != self.best_file(keep):
                path.unlink(missing_ok=True)


@torch.no_grad()
def _load_trainable(trainable: Dict[str, torch.Tensor], state: Dict[str, torch.Tensor]) -> None:
    for name, param in trainable.items():
        param.copy_(state[name].to(param.device))


def _save_checkpoint(path: Path, content: dict) -> None:
    """Written whole, then renamed: a run killed while saving leaves the previous checkpoint, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(content, tmp)
    os.replace(tmp, path)
