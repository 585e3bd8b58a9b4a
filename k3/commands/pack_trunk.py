"""`k3 pack-trunk MODEL OUT`: the dense trunk as one aligned file, for --trunk."""

from __future__ import annotations

import sys

HELP = "pack the dense trunk into one file for streaming (trunk.bin + trunk.json)"
DESCRIPTION = ("Copy every layer's non-expert tensors into OUT/trunk.bin (one 4096-aligned run per layer) and "
               "describe them in OUT/trunk.json. Interrupted packs resume by layer.")


def add_arguments(p) -> None:
    p.add_argument("model", help="model folder (config.json, model.safetensors.index.json, shards)")
    p.add_argument("out", help="output folder for trunk.bin + trunk.json (created)")
    p.add_argument("--config", help="config.json to use instead of MODEL/config.json")
    p.add_argument("--model-dirs", nargs="+", metavar="DIR", default=[],
                   help="more folders holding the checkpoint's shards (as for k3 run)")
    p.add_argument("--force", action="store_true", help="re-pack even if OUT already holds this trunk")
    p.add_argument("--restart", action="store_true", help="start over instead of resuming an interrupted pack")
    p.add_argument("--verify", action="store_true",
                   help="re-hash every byte of the packed trunk in OUT, from the shards and from trunk.bin, against "
                        "the hashes recorded when packing (exit 3 when a layer differs); when all match, shards that "
                        "were only copied or touched are accepted again")


def run(args) -> int:
    from ..errors import EXIT_CHECKPOINT
    from ..memory.trunk import pack_trunk, verify_trunk

    if args.verify:
        bad = verify_trunk(args.model, args.out, None, config_path=args.config, model_dirs=args.model_dirs)
        if bad:
            print(f"k3: the packed trunk in {args.out} differs from the checkpoint in layers {bad}; re-pack it with "
                  f"`k3 pack-trunk {args.model} {args.out} --force`.", file=sys.stderr)
            return EXIT_CHECKPOINT
        return 0
    pack_trunk(args.model, args.out, None, config_path=args.config, force=args.force, restart=args.restart,
               model_dirs=args.model_dirs)
    return 0
