"""The one configuration dataclass of sglang-ssd.

Where SGLang has a flag we use it; everything else comes from one JSON object in the
``SGLANG_SSD_CONFIG`` environment variable (inline JSON, or a path to a ``.json`` file):

=====================  ==========================================  =========================
setting                source                                      default
=====================  ==========================================  =========================
draft model            ``--speculative-draft-model-path``          (required)
K (drafts per round)   ``--speculative-num-steps``                 4
fan_out (per depth)    ``SGLANG_SSD_CONFIG["fan_out"]``            3 (uniform; B = F*(K+1))
mode                   ``SGLANG_SSD_CONFIG["mode"]``               "async" (SSD); "sync" = SD
fan_out_auto           ``SGLANG_SSD_CONFIG["fan_out_auto"]``       true: re-fit the fan-outs online
                                                                   (Theorem 12), budget = sum(fan_out);
                                                                   false: fan_out as given (measured:
                                                                   results/saguaro_bench.md)
backup                 ``SGLANG_SSD_CONFIG["backup"]``             null = by draft device:
                                                                   "hybrid" for a CPU draft in async
                                                                   mode (measured: results/
                                                                   variants_hybrid_draft2.md),
                                                                   else "neural"; "neural" (draft
                                                                   decodes just in time); "fast"
                                                                   (n-gram / random tokens); "hybrid"
                                                                   (one draft step, n-gram after it);
                                                                   "auto"
                                                                   (by batch size, Cor. 16)
saguaro_c              ``SGLANG_SSD_CONFIG["saguaro_c"]``          1.0 (Saguaro sampling C in (0, 1];
                                                                   per request: sampling_params
                                                                   custom_params {"saguaro_c": C})
draft_device           ``SGLANG_SSD_CONFIG["draft_device"]``       "auto": cpu for a CPU target; on GPU
                                                                   a GPU the target does not use, else
                                                                   the target's own (logged: SSD then
                                                                   shares it); or "cpu" / "cuda:N"
draft_endpoint         ``SGLANG_SSD_CONFIG["draft_endpoint"]``     null = a fresh ipc:// path; a
                                                                   non-loopback tcp:// one needs
                                                                   curve_keys
curve_keys             ``SGLANG_SSD_CONFIG["curve_keys"]``         null; else a CurveZMQ key dir
                                                                   (python -m sglang_ssd.draft.curve
                                                                   keygen DIR): encrypted channel,
                                                                   draft accepts only this worker
early_prefill          ``SGLANG_SSD_CONFIG["early_prefill"]``      true: send the draft each prompt
                                                                   while the target prefills it
                                                                   (and build round 0 meanwhile)
send_ahead             ``SGLANG_SSD_CONFIG["send_ahead"]``         true: tell the draft a round's outcome
                                                                   the moment its verify is done (the next
                                                                   Speculate overlaps SGLang's work
                                                                   between rounds); false: at the next
                                                                   round's start
spawn_draft            ``SGLANG_SSD_CONFIG["spawn_draft"]``        true: start the draft process
                                                                   bound to draft_endpoint; false:
                                                                   connect to a running one there
draft_dtype            ``SGLANG_SSD_CONFIG["draft_dtype"]``        "auto" (bfloat16 on cuda; on cpu bfloat16 where measured faster, else float32)
draft_cpu_core         ``SGLANG_SSD_CONFIG["draft_cpu_core"]``     last core (CPU draft)
target_cpu_core        ``SGLANG_SSD_CONFIG["target_cpu_core"]``    null (no pinning)
draft_threads          ``SGLANG_SSD_CONFIG["draft_threads"]``      1
draft_timeout_s        ``SGLANG_SSD_CONFIG["draft_timeout_s"]``    60 (prefill / release / hello)
round_deadline_s       ``SGLANG_SSD_CONFIG["round_deadline_s"]``   1.0: longest the target waits
                                                                   for a round's drafts; past it
                                                                   the round decodes target-only
                                                                   and the link reconnects
startup_timeout_s      ``SGLANG_SSD_CONFIG["startup_timeout_s"]``  null: 120 for a CPU draft, 900 for a
                                                                   CUDA one (its first start JIT-compiles
                                                                   FlashInfer before READY)
stats_interval         ``SGLANG_SSD_CONFIG["stats_interval"]``     50 rounds between log lines
batch_k                ``SGLANG_SSD_CONFIG["batch_k"]``            true (CPU engine): at batch >= 2 a
                                                                   round verifies only the first k <= K
                                                                   drafts, k of the best predicted
                                                                   speedup at that batch size (measured
                                                                   linear costs); false: always K; an
                                                                   integer: at most that many
stats_file             ``SGLANG_SSD_CONFIG["stats_file"]``         null; else JSON stats, every round
=====================  ==========================================  =========================

Every error names the flag or key at fault.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

ENV_VAR = "SGLANG_SSD_CONFIG"
DRAFT_FLAG = "--speculative-draft-model-path"
K_FLAG = "--speculative-num-steps"
MAX_K = 16
MODES = ("async", "sync")


class SaguaroConfigError(ValueError):
    """A bad saguaro setting; the message names the flag or config key."""


@dataclass
class SaguaroConfig:
    draft_model_path: str
    num_spec_tokens: int = 4
    target_model_path: Optional[str] = None  # --model-path (an EAGLE-3 draft reads the target's embedding)
    fan_out: list[int] = field(default_factory=list)  # len K+1 after validation
    mode: str = "async"
    saguaro_c: float = 1.0
    backup: Optional[str] = None  # resolve_backup: null = by draft device and mode
    fan_out_auto: bool = True  # fitted schedule: hit rate 0.38 -> 0.44 at T=0 on the CPU pair
    draft_device: str = "auto"  # resolve_draft_device, at worker start
    draft_endpoint: Optional[str] = None
    spawn_draft: bool = True
    early_prefill: bool = True
    send_ahead: bool = True  # sglang/ahead.py
    curve_keys: Optional[str] = None
    draft_dtype: str = "auto"
    draft_cpu_core: Optional[int] = None
    target_cpu_core: Optional[int] = None
    draft_threads: int = 1
    draft_timeout_s: float = 60.0
    round_deadline_s: float = 1.0
    startup_timeout_s: Optional[float] = None  # draft_startup_timeout()
    stats_interval: int = 50
    auto_k: bool = True  # CPU engine, no --speculative-num-steps: K from measured verify costs (spec_algo.default_k)
    alpha_prior: float = 0.5  # the acceptance auto_k assumes (the default SmolLM2 draft: ~0.50 held out)
    batch_k: Any = True  # False | True (measured per batch size, sglang/round_k.py) | int cap on drafts verified
    stats_file: Optional[str] = None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_sources(cls, draft_model_path: Optional[str], num_steps: Optional[int],
                     env: Optional[dict] = None) -> "SaguaroConfig":
        extra = load_env_config(os.environ if env is None else env)
        known = {f.name for f in dataclasses.fields(cls)} - {"draft_model_path", "num_spec_tokens",
                                                              "target_model_path"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise SaguaroConfigError(
                f"{ENV_VAR}: unknown key(s) {unknown}; known keys: {sorted(known)}")
        if not draft_model_path:
            raise SaguaroConfigError(
                f"saguaro needs a draft model: pass {DRAFT_FLAG} DIR (a Hugging Face checkpoint "
                "directory sharing the target's tokenizer)")
        cfg = cls(draft_model_path=str(draft_model_path),
                  num_spec_tokens=4 if num_steps is None else num_steps, **extra)
        cfg.validate()
        return cfg

    @classmethod
    def from_server_args(cls, server_args: Any) -> "SaguaroConfig":
        cfg = cls.from_sources(getattr(server_args, "speculative_draft_model_path", None),
                               getattr(server_args, "speculative_num_steps", None))
        cfg.target_model_path = getattr(server_args, "model_path", None)
        return cfg

    # ---- validation ---------------------------------------------------------------------
    def validate(self) -> None:
        k = self.num_spec_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_K:
            raise SaguaroConfigError(f"{K_FLAG} must be an integer in [1, {MAX_K}], got {k!r}")
        self.fan_out = _fan_out_list(self.fan_out, k)
        if self.mode not in MODES:
            raise SaguaroConfigError(f"{ENV_VAR} key 'mode' must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.fan_out_auto, bool):
            raise SaguaroConfigError(f"{ENV_VAR} key 'fan_out_auto' must be true or false")
        from sglang_ssd.protocol import BACKUPS  # the one list of backup kinds (the wire validates it too)
        if self.backup is not None and self.backup not in BACKUPS:
            raise SaguaroConfigError(f"{ENV_VAR} key 'backup' must be one of {BACKUPS}, got {self.backup!r}")
        if check_saguaro_c(self.saguaro_c) is None:
            raise SaguaroConfigError(f"{ENV_VAR} key 'saguaro_c' must be a number in (0, 1], got {self.saguaro_c!r}")
        if not isinstance(self.draft_device, str) or not (
                self.draft_device in ("auto", "cpu") or self.draft_device.startswith("cuda")):
            raise SaguaroConfigError(
                f"{ENV_VAR} key 'draft_device' must be 'auto', 'cpu' or 'cuda[:N]', got {self.draft_device!r}")
        if self.draft_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise SaguaroConfigError(
                f"{ENV_VAR} key 'draft_dtype' must be auto, float32, bfloat16 or float16, got {self.draft_dtype!r}")
        if self.draft_endpoint is not None and not str(self.draft_endpoint).startswith(("ipc://", "tcp://")):
            raise SaguaroConfigError(
                f"{ENV_VAR} key 'draft_endpoint' must be an ipc:// or tcp:// address, got {self.draft_endpoint!r}")
        for key in ("early_prefill", "send_ahead"):
            if not isinstance(getattr(self, key), bool):
                raise SaguaroConfigError(f"{ENV_VAR} key {key!r} must be true or false")
        if not isinstance(self.spawn_draft, bool):
            raise SaguaroConfigError(f"{ENV_VAR} key 'spawn_draft' must be true or false")
        if not self.spawn_draft and self.draft_endpoint is None:
            raise SaguaroConfigError(f"{ENV_VAR}: 'spawn_draft' false needs 'draft_endpoint' (where the "
                                     "draft process listens; start it with python -m sglang_ssd.draft)")
        self._validate_curve()
        for key in ("draft_cpu_core", "target_cpu_core"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise SaguaroConfigError(f"{ENV_VAR} key {key!r} must be a core index >= 0 or null, got {v!r}")
        if not isinstance(self.draft_threads, int) or self.draft_threads < 1:
            raise SaguaroConfigError(f"{ENV_VAR} key 'draft_threads' must be an integer >= 1")
        for key in ("draft_timeout_s", "round_deadline_s", "startup_timeout_s"):
            v = getattr(self, key)
            if v is None and key == "startup_timeout_s":
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise SaguaroConfigError(f"{ENV_VAR} key {key!r} must be a positive number of seconds, got {v!r}")
        if not isinstance(self.auto_k, bool):
            raise SaguaroConfigError(f"{ENV_VAR} key 'auto_k' must be true or false")
        check_alpha_prior(self.alpha_prior)
        if not (isinstance(self.batch_k, bool) or (isinstance(self.batch_k, int) and self.batch_k >= 1)):
            raise SaguaroConfigError(f"{ENV_VAR} key 'batch_k' must be true, false or an integer >= 1, "
                                     f"got {self.batch_k!r}")
        if not isinstance(self.stats_interval, int) or self.stats_interval < 1:
            raise SaguaroConfigError(f"{ENV_VAR} key 'stats_interval' must be an integer >= 1")
        validate_draft_path(self.draft_model_path)

    def _validate_curve(self) -> None:
        """curve_keys must hold the worker's keys (and the draft's too when we spawn it); without it a
        non-loopback draft_endpoint is refused here, at launch, rather than at the first connect."""
        from sglang_ssd.draft import curve  # zmq only; the draft side's one definition of the layout
        from sglang_ssd.draft.endpoint import InsecureEndpointError, check_endpoint

        if self.curve_keys is None:
            if self.draft_endpoint is not None:
                try:
                    check_endpoint(str(self.draft_endpoint), curve=False, action="use")
                except InsecureEndpointError as exc:
                    raise SaguaroConfigError(f"{ENV_VAR} key 'draft_endpoint' without 'curve_keys': {exc}") from None
            return
        if not isinstance(self.curve_keys, str) or not self.curve_keys:
            raise SaguaroConfigError(f"{ENV_VAR} key 'curve_keys' must be a directory path or null, "
                                     f"got {self.curve_keys!r}")
        try:
            curve.check_key_dir(self.curve_keys, curve.CLIENT)
            if self.spawn_draft:
                curve.check_key_dir(self.curve_keys, curve.SERVER)
        except curve.CurveKeyError as exc:
            raise SaguaroConfigError(f"{ENV_VAR} key 'curve_keys': {exc}") from None

    def draft_startup_timeout(self) -> float:
        """How long the worker waits for a spawned draft's READY: a CUDA draft's first start compiles
        flashinfer's kernels (JIT, cached on disk afterwards), which can take minutes."""
        if self.startup_timeout_s is not None:
            return float(self.startup_timeout_s)
        return 900.0 if str(self.draft_device).startswith("cuda") else 120.0

    @property
    def budget(self) -> int:
        """B: speculations pre-computed per request per round."""
        return sum(self.fan_out)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def resolve_draft_device(setting: str, target_device: str, target_gpus: set[int], n_gpus: int) -> tuple[str, str]:
    """draft_device "auto" -> (device, why).  A CPU target gets a CPU draft; a GPU target the first GPU
    it does not use (SSD's premise: the draft on its own device), else its own first GPU -- then draft
    and target share one device and SSD can only be slower than on two.  Explicit settings stand."""
    if setting != "auto":
        return setting, "configured"
    if not str(target_device).startswith("cuda"):
        return "cpu", "the target runs on the CPU"
    free = [i for i in range(n_gpus) if i not in target_gpus]
    if free:
        return f"cuda:{free[0]}", "the first GPU the target does not use"
    own = min(target_gpus) if target_gpus else 0
    return f"cuda:{own}", (f"no free GPU ({n_gpus} visible, all used by the target): the draft SHARES the "
                           "target's GPU, so drafting competes with verification")


def resolve_backup(setting: Optional[str], draft_device: str, mode: str, spawned: bool = True) -> str:
    """backup null -> the kind to use.  Sync mode (SD) drafts every round with the neural draft (its
    "backup" IS the draft).  In async mode a CPU draft answers misses with the hybrid backup (one draft
    step, n-gram copies after it).  On the 2-core CPU pair the fast (n-gram / random) backup was as fast or
    faster than the neural one in 11 of 12 cells (b = 1-8, T = 0 / 1; results/variants_backup_kind.md,
    variants_backup_auto.md), cutting the target's wait for the draft from 13-40 ms to 2-6 ms per round;
    the hybrid one keeps most of that (8-24 ms) and lifts a missed row's tokens per round from 1.06-1.27 to
    1.38-1.47, 1.05-1.13x the fast one in 3 of 4 cells and 0.97x in one (b = 1 / 4, T = 0 / 1,
    results/variants_hybrid_draft2.md).  A GPU draft keeps the neural backup (the
    paper's choice at small batch, where the draft's decode is cheap), and so does a draft the worker did
    not start (spawned False: its device is not known here).  Explicit settings stand."""
    if setting is not None:
        return setting
    return "hybrid" if spawned and mode == "async" and str(draft_device) == "cpu" else "neural"


def check_saguaro_c(v: Any) -> Optional[float]:
    """A valid Saguaro sampling C (a number in (0, 1]) as float, else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < float(v) <= 1.0:
        return None
    return float(v)


def check_alpha_prior(v: Any) -> float:
    """The config's alpha_prior (a number in [0, 1)) as float; else a SaguaroConfigError naming the key."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= float(v) < 1.0:
        raise SaguaroConfigError(f"{ENV_VAR} key 'alpha_prior' must be a number in [0, 1), got {v!r}")
    return float(v)


def env_number(name: str, default, env=None, cast=int):
    """A non-negative number from environment variable ``name`` (``default`` when unset or blank).

    ``cast`` is int or float; a value it cannot parse, or a negative one, raises a ValueError naming ``name``.
    """
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return default
    kind = "an integer" if cast is int else "a number"
    try:
        value = cast(raw)
    except ValueError:
        raise ValueError(f"{name} must be {kind} >= 0, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be {kind} >= 0, got {raw!r}")
    return value


def env_flag(name: str, default: bool, env=None) -> bool:
    """An on/off switch from environment variable ``name``: 1/true/on or 0/false/off (``default`` when
    unset or blank); anything else raises a ValueError naming ``name``."""
    raw = (os.environ if env is None else env).get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw in ("1", "true", "on")


def load_env_config(env) -> dict:
    raw = env.get(ENV_VAR, "").strip()
    if not raw:
        return {}
    text = raw
    if not raw.startswith("{"):
        if not os.path.isfile(raw):
            raise SaguaroConfigError(f"{ENV_VAR} must be a JSON object or the path of a JSON file; "
                                     f"{raw!r} is neither")
        with open(raw) as fh:
            text = fh.read()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SaguaroConfigError(f"{ENV_VAR} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise SaguaroConfigError(f"{ENV_VAR} must hold a JSON object, got {type(obj).__name__}")
    return obj


def _fan_out_list(fan_out: Any, k: int) -> list[int]:
    if fan_out is None or fan_out == []:
        fan_out = 3
    if isinstance(fan_out, int) and not isinstance(fan_out, bool):
        fan_out = [fan_out] * (k + 1)
    if (not isinstance(fan_out, list) or len(fan_out) != k + 1
            or not all(isinstance(f, int) and not isinstance(f, bool) and 0 <= f <= 64 for f in fan_out)):
        raise SaguaroConfigError(
            f"{ENV_VAR} key 'fan_out' must be an integer in [0, 64] or a list of K+1 = {k + 1} such "
            f"integers (K from {K_FLAG}), got {fan_out!r}")
    if sum(fan_out) == 0:
        raise SaguaroConfigError(f"{ENV_VAR} key 'fan_out' must cache at least one branch (sum > 0)")
    return list(fan_out)


def is_eagle3_config(hf: dict) -> bool:
    """A Hugging Face config dict naming an EAGLE-3 draft head (e.g. LlamaForCausalLMEagle3)."""
    return any("eagle3" in str(a).lower() for a in hf.get("architectures") or [])


def validate_draft_path(path: str) -> None:
    """Fail early, naming the flag, when the draft checkpoint is missing or unusable."""
    if not os.path.isdir(path):
        raise SaguaroConfigError(f"{DRAFT_FLAG}: {path!r} is not a directory (expected a Hugging Face "
                                 "checkpoint directory with config.json and *.safetensors)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise SaguaroConfigError(f"{DRAFT_FLAG}: {path!r} has no config.json")
    try:
        with open(cfg_path) as fh:
            hf = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise SaguaroConfigError(f"{DRAFT_FLAG}: cannot read {cfg_path}: {exc}") from None
    if not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise SaguaroConfigError(f"{DRAFT_FLAG}: {path!r} holds no *.safetensors weights")
    archs = hf.get("architectures") or []
    if is_eagle3_config(hf):
        if not any(a == "LlamaForCausalLMEagle3" for a in archs):
            raise SaguaroConfigError(f"{DRAFT_FLAG}: unsupported EAGLE-3 architecture {archs}; supported: "
                                     "LlamaForCausalLMEagle3 (SpecForge's layout)")
        return
    if not any(a in ("LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM") for a in archs):
        raise SaguaroConfigError(f"{DRAFT_FLAG}: unsupported draft architecture {archs}; "
                                 "supported: LlamaForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, and EAGLE-3 "
                                 "heads (LlamaForCausalLMEagle3)")
