"""``python -m dlmix.pd.reference``: run a reference producer (see :mod:`dlmix.pd.reference`).

Prints one JSON line ``{"url", "kv", "layout", "registration"}`` on stdout once it serves (``registration``: the
router registration body of this instance, :meth:`~dlmix.pd.reference.producer.ReferenceProducer.registration`),
then runs until SIGINT/SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading


def serve(argv: list[str] | None = None) -> int:
    """Parse flags, start the producer and its HTTP server, block until a signal. Returns the exit code."""
    from .producer import ReferenceConfig, ReferenceProducer
    from .server import ReferenceHTTPServer

    ap = argparse.ArgumentParser(prog="python -m dlmix.pd.reference", description=__doc__)
    ap.add_argument("--model", required=True, help="Hugging Face model folder")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="HTTP port (0 = any free port)")
    ap.add_argument("--served-model-name", default="smollm2")
    ap.add_argument("--arrangement", default="lmdeploy", help="KV cache arrangement (dlmix.kv.ARRANGEMENTS)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="fp16", help="KV cache dtype: fp32, bf16, fp16")
    ap.add_argument("--compute-dtype", default="float32", help="forward pass dtype")
    ap.add_argument("--kv-cache-bytes", type=int, default=128 << 20)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--kv-host", default="127.0.0.1")
    ap.add_argument("--kv-port", type=int, default=0)
    ap.add_argument("--secret", default=None, help="transport shared secret (loopback default if unset)")
    ap.add_argument("--hold-timeout-s", type=float, default=120.0)
    ap.add_argument("--io-timeout-s", type=float, default=30.0)
    ap.add_argument("--no-verify-weights", action="store_true")
    ap.add_argument("--perturb-token", type=int, default=None,
                    help="test hook: prefill with this prompt position's token id changed by one")
    ap.add_argument("--log-level", default="INFO")
    a = ap.parse_args(argv)
    for flag, port in (("--port", a.port), ("--kv-port", a.kv_port)):
        if not 0 <= port <= 65535:
            ap.error(f"{flag} must be in 0..65535 (0 = any free port), got {port}")
    if not os.path.isdir(a.model):
        ap.error(f"--model: no model folder {a.model!r} (a local Hugging Face folder, e.g. "
                 f"$(dlmix models prepare smollm2))")
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = ReferenceConfig(model_dir=a.model, served_model_name=a.served_model_name, arrangement=a.arrangement,
                          block_size=a.block_size, dtype=a.dtype, kv_cache_bytes=a.kv_cache_bytes,
                          compute_dtype=a.compute_dtype, max_model_len=a.max_model_len, transport=a.transport,
                          kv_host=a.kv_host, kv_port=a.kv_port, secret=a.secret, hold_timeout_s=a.hold_timeout_s,
                          io_timeout_s=a.io_timeout_s, verify_weights=not a.no_verify_weights,
                          perturb_token=a.perturb_token)
    try:
        app = ReferenceProducer(cfg)
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        http = ReferenceHTTPServer(app, a.host, a.port)
    except OSError as e:  # port taken, host not local
        app.close()
        print(f"error: cannot serve HTTP on {a.host}:{a.port}: {e}", file=sys.stderr)
        return 2
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    http.serve_in_thread()
    print(json.dumps({"url": http.url, "kv": app.core_descriptor(), "layout": app.layout.to_dict(),
                      "registration": app.registration(http.url)}), flush=True)
    done.wait()
    http.close()
    app.close()
    return 0


def main() -> None:
    """Run :func:`serve` and leave with its code through ``os._exit``, after flushing logs and stdio: the HTTP
    server's per-connection daemon threads (a keep-alive connection parks one in ``recv``) must not be running
    while the interpreter finalizes, where a daemon thread writing to stderr aborts the process (SIGABRT)."""
    code = serve()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
