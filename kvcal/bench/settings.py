"""`BenchSettings`: what `kvcal bench` measures and how much of it (`--quick` presets, lengths, seeds, methods)."""

from __future__ import annotations

from dataclasses import dataclass

from kvcal.runtime.options import ServeOptions


@dataclass
class BenchSettings:
    quick: bool = False
    seed: int = 0
    serve: ServeOptions = ServeOptions()  # how the kvcal caches are served (attention backend: auto, torch, cpu, cuda)
    dataset: str = "default"              # corpus for held-out quality text (eval split) and Palu's whitening (calib)
    windows: int = 8                      # held-out windows for quality
    prompt: int = 1024                    # prompt tokens per window
    steps: int = 64                       # teacher-forced decode steps per window (windows x steps predictions)
    passkey_lengths: tuple[int, ...] = (1024, 4096, 16384)
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    passkey_tokens: int = 8               # greedy tokens generated for the answer
    contexts: tuple[int, ...] = (1024, 4096, 16384)   # speed: context lengths
    speed_steps: int = 16                 # speed: decode steps averaged per context
    calib_windows: int = 4                # calibration windows (of `prompt` tokens): Palu, KVTuner-style sensitivity
    methods: tuple[str, ...] | None = None   # keys / families / series to run (None: all); kvcal joint always runs
    target_top1: float | None = None      # top-1 of the quality target (None: the bundle's, `bundle_target`)
    command: str | None = None            # the command line, recorded in the report

    QUICK = {"windows": 4, "prompt": 512, "steps": 32, "passkey_lengths": (1024,), "contexts": (1024,),
             "speed_steps": 8, "calib_windows": 2}

    @classmethod
    def preset(cls, quick: bool = False, **overrides) -> BenchSettings:
        """Full settings, or `--quick` ones (a few minutes for a 135M model on 2 cores); `overrides` win."""
        base = dict(cls.QUICK) if quick else {}
        return cls(quick=quick, **{**base, **{k: v for k, v in overrides.items() if v is not None}})

    def __post_init__(self):
        for name in ("windows", "prompt", "steps", "passkey_tokens", "speed_steps", "calib_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}={getattr(self, name)}` must be >= 1")
        if any(c < 1 for c in (*self.contexts, *self.passkey_lengths)):
            raise ValueError("context and passkey lengths must be >= 1")
        if any(not 0 <= x <= 1 for x in self.passkey_depths):
            raise ValueError(f"passkey depths {self.passkey_depths} must lie in [0, 1]")
        if self.target_top1 is not None and not 0 < self.target_top1 <= 1:
            raise ValueError(f"`--target-top1 {self.target_top1:g}` must lie in (0, 1]")
