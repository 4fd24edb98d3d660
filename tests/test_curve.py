"""CurveZMQ on the draft channel: non-loopback endpoints are refused without keys; with keys the
draft answers only authorized workers, and the ZAP authenticator lives and dies with the server."""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest
import torch

from sglang_ssd.config import SaguaroConfig, SaguaroConfigError
from sglang_ssd.draft import curve
from sglang_ssd.draft.__main__ import main as draft_main
from sglang_ssd.draft.client import DraftClient, DraftTimeout, DraftUnsent
from sglang_ssd.draft.endpoint import InsecureEndpointError, is_loopback, normalize_endpoint
from sglang_ssd.draft.server import DraftServer
from tests.tiny_models import make_tiny_model

torch.set_num_threads(1)

BAD_PEER_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def model_dir():
    return make_tiny_model(vocab_size=96, seed=1)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("curve") / "keys")
    assert curve.main(["keygen", d]) == 0
    return d


def _env(**kw) -> dict:
    return {"SGLANG_SSD_CONFIG": json.dumps(kw)}


def test_keygen_layout_permissions_and_no_silent_overwrite(keys):
    for name in ("server.key", "server.key_secret", "client.key", "client.key_secret", "authorized_clients/client.key"):
        assert os.path.isfile(os.path.join(keys, name)), name
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE(os.stat(os.path.join(keys, name)).st_mode) == 0o600
    with open(os.path.join(keys, "client.key")) as a, open(os.path.join(keys, "authorized_clients/client.key")) as b:
        assert a.read() == b.read()
    curve.check_key_dir(keys, curve.SERVER)
    curve.check_key_dir(keys, curve.CLIENT)
    assert curve.main(["keygen", keys]) == 2  # existing keys are kept unless --force
    with pytest.raises(curve.CurveKeyError, match="--force"):
        curve.keygen(keys)


def test_non_loopback_endpoints_refused_without_keys(model_dir, tmp_path):
    for ep in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://[::]:5555", "tcp://10.1.2.3:5555",
               "tcp://draft.example.com:5555", "tcp://127.0.0.1:5;10.1.2.3:5555"):
        assert not is_loopback(ep), ep
        with pytest.raises(InsecureEndpointError) as exc:
            normalize_endpoint(ep)
        msg = str(exc.value)
        assert repr(ep) in msg and "python -m sglang_ssd.draft.curve keygen DIR" in msg and "--curve-keys" in msg
        assert normalize_endpoint(ep, curve=True) == ep
    for ep in ("tcp://127.0.0.1:5555", "tcp://127.9.8.7:1", "tcp://localhost:1", "tcp://[::1]:1",
               "tcp://[::ffff:127.0.0.1]:1", "ipc:///tmp/x.sock"):
        assert is_loopback(ep), ep
    # server side: refused before the model is loaded; the CLI exits 2 with the message logged
    with pytest.raises(InsecureEndpointError, match="refusing to bind .*0.0.0.0"):
        DraftServer.from_model_dir(model_dir, "tcp://0.0.0.0:5555")
    assert draft_main(["--model", model_dir, "--bind", "tcp://0.0.0.0:5555"]) == 2
    assert draft_main(["--model", model_dir, "--bind", "tcp://0.0.0.0:5555", "--curve-keys", str(tmp_path)]) == 2
    with pytest.raises(curve.CurveKeyError, match="lacks"):
        DraftServer.from_model_dir(model_dir, "tcp://0.0.0.0:*", curve_keys=str(tmp_path))
    # client side
    with pytest.raises(InsecureEndpointError, match=r"refusing to connect .*10\.1\.2\.3.*curve_keys"):
        DraftClient("tcp://10.1.2.3:5555", timeout_s=1)


def test_curve_server_answers_only_authorized_workers(model_dir, keys, tmp_path):
    server = DraftServer.from_model_dir(model_dir, "tcp://0.0.0.0:*", curve_keys=keys)
    auth = server.auth
    assert server.curve and auth is not None and auth.is_alive()
    ep = "tcp://127.0.0.1:" + server.endpoint.rsplit(":", 1)[1]
    intruder = str(tmp_path / "intruder")  # knows the draft's public key, but its own key is not authorized
    curve.keygen(intruder)
    shutil.copy(os.path.join(keys, "server.key"), os.path.join(intruder, "server.key"))
    thread = server.start_in_thread()
    good = DraftClient(ep, timeout_s=20, curve_keys=keys)
    try:
        assert good.health()["live_requests"] == 0
        with DraftClient(ep, timeout_s=BAD_PEER_TIMEOUT_S) as plain:  # a plain DEALER, no CurveZMQ
            with pytest.raises((DraftTimeout, DraftUnsent)):  # no reply, or no connection to send on
                plain.health()
        with DraftClient(ep, timeout_s=BAD_PEER_TIMEOUT_S, curve_keys=intruder) as bad:
            with pytest.raises((DraftTimeout, DraftUnsent)):
                bad.health()
        stats = good.health()  # still serving the good client; the others never reached the handler
        assert stats["protocol_errors"] == 0 and stats["handler_errors"] == 0
        good.shutdown()
    finally:
        good.close()
        server.stop(10)
    assert not thread.is_alive()
    assert not auth.is_alive() and server.auth is None and server.sock.closed and server.ctx.closed


def test_curve_keys_config(model_dir, keys, tmp_path):
    assert SaguaroConfig.from_sources(model_dir, 3, env={}).curve_keys is None
    cfg = SaguaroConfig.from_sources(model_dir, 3, env=_env(curve_keys=keys, draft_endpoint="tcp://0.0.0.0:5555"))
    assert cfg.curve_keys == keys
    worker = tmp_path / "worker"  # what a worker host with a remote draft holds: no draft secret
    worker.mkdir()
    for name in ("server.key", "client.key", "client.key_secret"):
        shutil.copy(os.path.join(keys, name), worker / name)
    remote = dict(spawn_draft=False, draft_endpoint="tcp://10.0.0.5:5555")
    cfg = SaguaroConfig.from_sources(model_dir, 3, env=_env(curve_keys=str(worker), **remote))
    assert cfg.curve_keys == str(worker)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    shutil.copy(os.path.join(keys, "server.key"), damaged / "server.key")
    (damaged / "client.key_secret").write_text("no keys here\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    for kw, needle in [(dict(curve_keys="/no/such/dir"), "'curve_keys'.*does not exist"),
                       (dict(curve_keys=str(empty)), "'curve_keys'.*lacks"),
                       (dict(curve_keys=str(worker)), "'curve_keys'.*server.key_secret"),  # spawned draft needs it
                       (dict(curve_keys=str(damaged), **remote), "'curve_keys'.*cannot read"),
                       (dict(curve_keys=5), "'curve_keys' must be a directory"),
                       (remote, "'draft_endpoint' without 'curve_keys'"),
                       (dict(draft_endpoint="tcp://0.0.0.0:5555"), "'draft_endpoint' without 'curve_keys'")]:
        with pytest.raises(SaguaroConfigError, match=needle):
            SaguaroConfig.from_sources(model_dir, 3, env=_env(**kw))


def test_draft_link_passes_the_keys_to_the_draft_and_the_client(model_dir, keys):
    from sglang_ssd.sglang.draft_link import DraftLink
    from sglang_ssd.sglang.draft_process import draft_command

    cfg = SaguaroConfig.from_sources(model_dir, 3, env=_env(curve_keys=keys))
    cmd = draft_command(cfg, "tcp://0.0.0.0:5555", torch.device("cpu"))
    assert cmd[cmd.index("--curve-keys") + 1] == keys
    # a worker connecting to a running curve draft: the hello handshake goes through
    server = DraftServer.from_model_dir(model_dir, "tcp://127.0.0.1:*", curve_keys=keys)
    server.start_in_thread()
    cfg = SaguaroConfig.from_sources(model_dir, 3, env=_env(curve_keys=keys, spawn_draft=False, fan_out=1,
                                                            draft_endpoint=server.endpoint, startup_timeout_s=20))
    link = DraftLink(cfg, vocab_size=96, eos_ids=[])
    try:
        assert link.client.health()["live_requests"] == 0
    finally:
        link.close()
        server.stop(10)
