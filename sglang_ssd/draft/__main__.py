"""python -m sglang_ssd.draft --model DIR --bind ENDPOINT [--device cpu|cuda:N] [--dtype auto|...] ...

Runs the SSD draft process: loads the draft checkpoint with our own runner (no SGLang import),
optionally pins itself to one CPU core, binds a ROUTER socket and serves until Shutdown/SIGTERM.
A non-loopback tcp --bind needs --curve-keys DIR (CurveZMQ; keys: python -m sglang_ssd.draft.curve keygen DIR).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

logger = logging.getLogger("sglang_ssd.draft")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_ssd.draft", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint dir (config.json + *.safetensors)")
    p.add_argument("--bind", default="ipc", help="ipc:///path.sock | tcp://127.0.0.1:PORT | 'ipc' | 'tcp' "
                   "(tcp defaults to 127.0.0.1; default: a fresh ipc:///tmp/sglang-ssd-<uuid>.sock)")
    p.add_argument("--target-model", default=None, metavar="DIR",
                   help="the target's checkpoint dir: an EAGLE-3 head reads its embedding and layer count")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on cuda; on cpu bfloat16 where measured faster (AMX / AVX512-BF16), else float32")
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "flashinfer"],
                   help="auto: FlashInfer custom-mask attention on cuda when flashinfer imports, else SDPA")
    p.add_argument("--no-cuda-graphs", action="store_true", help="FlashInfer path: run every forward eagerly")
    p.add_argument("--cpu-core", type=int, default=None, help="pin this process to one CPU core")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--max-batch", type=int, default=1024)
    p.add_argument("--curve-keys", default=None, metavar="DIR",
                   help="CurveZMQ key directory (server.key_secret + authorized_clients/): encrypt the channel "
                        "and accept only authorized workers; required for a non-loopback tcp --bind")
    p.add_argument("--ready-file", default=None, help="write {endpoint, pid} JSON here once serving")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [draft %(process)d] %(name)s: %(message)s")
    from sglang_ssd.draft import curve
    from sglang_ssd.draft.endpoint import normalize_endpoint

    try:  # a refused endpoint or a bad key directory fails here, before any slow import or load
        bind = normalize_endpoint(args.bind, curve=args.curve_keys is not None)
        if args.curve_keys is not None:
            curve.check_key_dir(args.curve_keys, curve.SERVER)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    if args.cpu_core is not None:
        os.sched_setaffinity(0, {args.cpu_core})
    import torch  # after pinning, so torch's thread pools start on the chosen core

    torch.set_num_threads(max(1, args.threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass

    from sglang_ssd.draft.server import DraftServer

    t0 = time.perf_counter()
    server = DraftServer.from_model_dir(args.model, bind, args.device, args.dtype, args.seed, args.max_batch,
                                        curve_keys=args.curve_keys, attention=args.attention,
                                        cuda_graphs=not args.no_cuda_graphs, target_dir=args.target_model)
    signal.signal(signal.SIGTERM, lambda *_: server._stop.set())
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"endpoint": server.endpoint, "pid": os.getpid()}, fh)
        os.replace(tmp, args.ready_file)
    cores = sorted(os.sched_getaffinity(0))
    runner = server.engine.runner
    # READY comes after DraftServer.from_model_dir, i.e. after the runner's FlashInfer warm-up (or its
    # fallback to SDPA) and its start-up CUDA-graph capture: nothing compiles or captures in a live round
    fallback = f" (FlashInfer fell back: {runner.backend_fallback})" if runner.backend_fallback else ""
    logger.info("READY endpoint=%s curve=%s model=%s device=%s dtype=%s attention=%s%s cuda_graphs=%d cores=%s "
                "threads=%d pid=%d load=%.1fs", server.endpoint, server.curve, args.model, args.device,
                str(runner.dtype).replace("torch.", ""), runner.backend, fallback,
                len(runner.graphs.graphs) if runner.graphs is not None else 0, cores, torch.get_num_threads(),
                os.getpid(), time.perf_counter() - t0)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
