"""Profile a model's layers on this machine (the measurements: :mod:`pipeflow.models.profiler`).

    python -m pipeflow.profile --out profile.json model=gpt_small model.n_layer=8

writes ``profile.json``: each layer's forward and backward time, saved activations and
parameters, for ``partition=profiled`` (``partition.profile``) and ``cost=profiled``.
"""

from __future__ import annotations

import argparse

from omegaconf import OmegaConf

from pipeflow.config import compose
from pipeflow.config import resolve_model
from pipeflow.models.profiler import profile_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="profile.json", help="where to write the profile")
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="train config overrides, e.g. model=gpt_small model.n_layer=8")
    args = parser.parse_args(argv)
    cfg = compose("train", args.overrides)
    resolve_model(cfg)  # an hf_causal model's shape keys, from its config
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    prof = profile_model(model_cfg, args.microbatch_size, seed=int(cfg.seed), threads=args.threads)
    print(f"wrote {prof.save(args.out)}")
    for u in prof.units:
        print(f"{u.name:<12} F {u.forward_s * 1e3:8.3f} ms  B {u.backward_s * 1e3:8.3f} ms  "
              f"act {u.activation_bytes / 2**20:8.2f} MiB  params {u.param_bytes / 2**20:7.2f} MiB")


if __name__ == "__main__":
    main()
