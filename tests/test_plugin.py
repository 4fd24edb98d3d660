"""Plugin discovery, registration and launch-time validation, in fresh processes like SGLang's own."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sglang_ssd.config import SaguaroConfig, SaguaroConfigError

PROBE = textwrap.dedent("""
    import json, os, sys
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang_ssd.sglang import plugin
    plugin.register(); plugin._registered = False; plugin.register()   # idempotent, even re-entered
    algo = SpeculativeAlgorithm.from_string("saguaro")
    # the hooks as SGLang applies them; the FlashInfer autotune warm-up asks base_runner's imported name
    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry
    HookRegistry.apply_hooks()
    from sglang.srt.model_executor.runner import base_runner
    dummy = base_runner.create_dummy_verify_input(algo, torch.ones(64, dtype=torch.bool), 5, False)
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.arg_groups.overrides import resolving_view
    out = {"class": type(algo).__module__ + "." + type(algo).__qualname__,
           "same": algo is SpeculativeAlgorithm.from_string("SAGUARO"),
           "need_topk": algo.need_topk(), "hidden": algo.carries_draft_hidden_states(),
           "draft_kv": algo.has_draft_kv(), "cases": [],
           "dummy": [type(dummy).__name__, dummy.draft_token_num, dummy.tree_topk, int(dummy.custom_mask.numel())]}
    for case in json.loads(sys.argv[1]):
        os.environ.pop("SGLANG_SSD_CONFIG", None)
        if case.get("env"):
            os.environ["SGLANG_SSD_CONFIG"] = case["env"]
        try:
            sa = prepare_server_args(["--model-path", sys.argv[2], "--device", "cpu"] + case["args"])
            sa.resolve_once()
            v = resolving_view(sa)
            out["cases"].append({"ok": [v.speculative_algorithm, v.speculative_num_steps, v.grammar_backend,
                                        v.speculative_num_draft_tokens, v.speculative_eagle_topk,
                                        v.disable_overlap_schedule, v.max_running_requests]})
        except Exception as exc:
            out["cases"].append({"error": f"{type(exc).__name__}: {exc}"})
    from sglang_ssd.sglang import spec_algo
    out["auto_k"] = spec_algo._AUTO_K
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def probe(target_path, draft_path, tmp_path_factory):
    bad_vocab = tmp_path_factory.mktemp("bad_vocab")
    cfg = json.load(open(os.path.join(draft_path, "config.json")))
    cfg["vocab_size"] = 1234
    json.dump(cfg, open(bad_vocab / "config.json", "w"))
    (bad_vocab / "model.safetensors").write_bytes(b"")
    draft = ["--speculative-draft-model-path", draft_path]
    cases = [
        {"args": ["--speculative-algorithm", "saguaro"] + draft},
        {"args": ["--speculative-algorithm", "SaGuArO", "--speculative-num-steps", "3"] + draft},
        {"args": ["--speculative-algorithm", "saguaro"]},
        {"args": ["--speculative-algorithm", "saguaro", "--speculative-draft-model-path", "/no/such/dir"]},
        {"args": ["--speculative-algorithm", "saguaro", "--speculative-num-steps", "4",
                  "--speculative-num-draft-tokens", "9"] + draft},
        {"args": ["--speculative-algorithm", "saguaro", "--speculative-num-steps", "40"] + draft},
        {"args": ["--speculative-algorithm", "saguaro"] + draft, "env": '{"mode": "turbo"}'},
        {"args": ["--speculative-algorithm", "saguaro", "--speculative-num-steps", "3"] + draft,
         "env": '{"fan_out": [1, 2]}'},
        {"args": ["--speculative-algorithm", "saguaro", "--speculative-draft-model-path", str(bad_vocab)]},
        {"args": ["--speculative-algorithm", "saguaro"] + draft, "env": '{"auto_k": false}'},
        {"args": ["--speculative-algorithm", "saguaro"] + draft, "env": '{"fan_out": [3, 2, 1]}'},
        {"args": ["--speculative-algorithm", "saguaro"] + draft, "env": '{"alpha_prior": 1.5}'},
        {"args": ["--speculative-algorithm", "saguaro", "--speculative-num-draft-tokens", "6"] + draft},
    ]
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases), target_path],
                          capture_output=True, text=True, timeout=600, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_entry_point_discovered_and_idempotent(probe):
    assert probe["class"] == "sglang_ssd.sglang.spec_algo.SaguaroAlgo"
    assert probe["same"] is True
    assert probe["need_topk"] is False and probe["hidden"] is False and probe["draft_kv"] is False


def test_dummy_verify_input_hooked_for_saguaro(probe):
    """spec_info.create_dummy_verify_input returns None for a custom algorithm; the hook gives the
    TARGET_VERIFY warm-up (FlashInfer autotune) a chain input over the runner's mask buffer."""
    assert probe["dummy"] == ["ChainVerifyInput", 5, 1, 64]


def test_server_args_defaults(probe, target_path):
    # CPU engine, no --speculative-num-steps: K measured on this CPU (spec_algo.default_k), once per launch
    k = probe["auto_k"][target_path]
    assert 1 <= k <= 5
    assert probe["cases"][0] == {"ok": ["SAGUARO", k, "xgrammar", k + 1, 1, True, 48]}
    assert probe["cases"][1] == {"ok": ["SAGUARO", 3, "xgrammar", 4, 1, True, 48]}
    assert probe["cases"][9] == {"ok": ["SAGUARO", 4, "xgrammar", 5, 1, True, 48]}   # auto_k false: DEFAULT_K
    assert probe["cases"][10] == {"ok": ["SAGUARO", 2, "xgrammar", 3, 1, True, 48]}  # a fan_out list says K
    assert probe["cases"][12] == {"ok": ["SAGUARO", 5, "xgrammar", 6, 1, True, 48]}  # so does the chain width


@pytest.mark.parametrize("i,needle", [
    (2, "--speculative-draft-model-path"),
    (3, "--speculative-draft-model-path: '/no/such/dir' is not a directory"),
    (4, "--speculative-num-draft-tokens must be K+1 = 5"),
    (5, "--speculative-num-steps must be an integer in [1, 16]"),
    (6, "SGLANG_SSD_CONFIG key 'mode'"),
    (7, "SGLANG_SSD_CONFIG key 'fan_out'"),
    (8, "draft vocab_size 1234 differs from the target's 49152"),
    (11, "SGLANG_SSD_CONFIG key 'alpha_prior'"),
])
def test_bad_settings_fail_with_clear_message(probe, i, needle):
    err = probe["cases"][i].get("error", "")
    assert "SaguaroConfigError" in err and needle in err, err


def test_config_dataclass(draft_path, tmp_path):
    cfg = SaguaroConfig.from_sources(draft_path, 3, env={"SGLANG_SSD_CONFIG": '{"fan_out": 2, "mode": "sync"}'})
    assert cfg.fan_out == [2, 2, 2, 2] and cfg.budget == 8 and cfg.mode == "sync"
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"fan_out": [4, 3, 2, 1, 1]}))
    assert SaguaroConfig.from_sources(draft_path, 4, env={"SGLANG_SSD_CONFIG": str(path)}).fan_out == [4, 3, 2, 1, 1]
    for env, key in [('{"nope": 1}', "unknown key"), ("[1]", "JSON object"), ("{bad", "not valid JSON"),
                     ('{"draft_endpoint": "http://x"}', "draft_endpoint"), ('{"fan_out": 0}', "at least one"),
                     ('{"draft_timeout_s": -1}', "draft_timeout_s"), ('{"round_deadline_s": 0}', "round_deadline_s"),
                     ('{"saguaro_c": 0}', "saguaro_c"),
                     ('{"saguaro_c": 1.5}', "saguaro_c"), ('{"saguaro_c": true}', "saguaro_c")]:
        with pytest.raises(SaguaroConfigError, match=key):
            SaguaroConfig.from_sources(draft_path, 4, env={"SGLANG_SSD_CONFIG": env})


def test_draft_device_auto(draft_path):
    from sglang_ssd.config import resolve_draft_device

    assert SaguaroConfig.from_sources(draft_path, 4, env={}).draft_device == "auto"
    with pytest.raises(SaguaroConfigError, match="draft_device"):
        SaguaroConfig.from_sources(draft_path, 4, env={"SGLANG_SSD_CONFIG": '{"draft_device": "tpu"}'})
    assert resolve_draft_device("auto", "cpu", set(), 0)[0] == "cpu"
    assert resolve_draft_device("auto", "cuda", {0}, 2)[0] == "cuda:1"         # a GPU of its own
    assert resolve_draft_device("auto", "cuda", {0, 1}, 4)[0] == "cuda:2"      # TP 2: the next free one
    dev, why = resolve_draft_device("auto", "cuda", {0}, 1)
    assert dev == "cuda:0" and "SHARES" in why                                  # one GPU: shared, logged
    assert resolve_draft_device("cuda:3", "cuda", {0}, 8) == ("cuda:3", "configured")
    assert resolve_draft_device("cpu", "cuda", {0}, 8)[0] == "cpu"
    # READY wait: a CUDA draft compiles flashinfer's kernels before READY on its first start
    cfg = SaguaroConfig.from_sources(draft_path, 4, env={})
    assert cfg.startup_timeout_s is None and cfg.draft_startup_timeout() == 120.0
    cfg.draft_device = "cuda:1"
    assert cfg.draft_startup_timeout() == 900.0
    assert SaguaroConfig.from_sources(draft_path, 4, env={"SGLANG_SSD_CONFIG": '{"startup_timeout_s": 30}'}
                                      ).draft_startup_timeout() == 30.0
    with pytest.raises(SaguaroConfigError, match="startup_timeout_s"):
        SaguaroConfig.from_sources(draft_path, 4, env={"SGLANG_SSD_CONFIG": '{"startup_timeout_s": 0}'})
    from types import SimpleNamespace

    from sglang_ssd.sglang.worker import target_gpus

    assert target_gpus(SimpleNamespace(base_gpu_id=2, gpu_id_step=1, tp_size=2, pp_size=1), 2) == {2, 3}


def test_saguaro_c_server_default_and_per_request_override(draft_path):
    """C comes from SGLANG_SSD_CONFIG; a request overrides it with custom_params {"saguaro_c": C};
    an invalid override falls back to the server's value (and is logged)."""
    from types import SimpleNamespace

    from sglang_ssd.sglang.draft_link import DraftLink

    cfg = SaguaroConfig.from_sources(draft_path, 4, env={"SGLANG_SSD_CONFIG": '{"saguaro_c": 0.8}'})
    assert cfg.saguaro_c == 0.8
    link = SimpleNamespace(cfg=cfg)
    req = lambda custom: SimpleNamespace(rid="r", sampling_params=SimpleNamespace(custom_params=custom))
    assert DraftLink._saguaro_c(link, req(None)) == 0.8
    assert DraftLink._saguaro_c(link, req({"saguaro_c": 0.5})) == 0.5
    assert DraftLink._saguaro_c(link, req({"saguaro_c": 1})) == 1.0
    for bad in (0, -1, 2, "0.5", None, True):
        assert DraftLink._saguaro_c(link, req({"saguaro_c": bad})) == 0.8


def test_backup_default_by_draft_device(draft_path):
    from sglang_ssd.config import resolve_backup

    cfg = SaguaroConfig.from_sources(draft_path, 4, env={})
    assert cfg.backup is None  # by device
    assert resolve_backup(None, "cpu", "async") == "hybrid"     # CPU draft: the measured-faster backup
    assert resolve_backup(None, "cuda:1", "async") == "neural"  # GPU draft: the paper's small-batch choice
    assert resolve_backup(None, "auto", "async") == "neural"    # a remote draft of unknown device
    assert resolve_backup(None, "cpu", "sync") == "neural"      # SD drafts with the draft model itself
    assert resolve_backup(None, "cpu", "async", spawned=False) == "neural"  # a draft we did not start
    for kind in ("neural", "fast", "hybrid", "auto"):
        assert resolve_backup(kind, "cpu", "sync") == kind      # explicit settings stand
        assert SaguaroConfig.from_sources(draft_path, 4, env={"SGLANG_SSD_CONFIG": f'{{"backup": "{kind}"}}'}).backup == kind
    with pytest.raises(SaguaroConfigError, match="backup"):
        SaguaroConfig.from_sources(draft_path, 4, env={"SGLANG_SSD_CONFIG": '{"backup": "ngram"}'})
