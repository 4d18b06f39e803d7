"""Static SASS instruction counts of the built W4A16 kernels, per kernel and opcode class.

`python3 bench/scripts/sass_counts.py [--filter wgmma_kernel] [--out FILE.json]`: builds (or
reuses) the CUDA extension, runs `cuobjdump -sass` on it and counts, per kernel, the instructions
by opcode (the first mnemonic, e.g. LOP3, HMUL2, LDGSTS, HGMMA, BAR). A static count of the
unrolled body is what a profile-free instruction budget needs: the integer operations per decoded
weight, the copy instructions per group, the tensor-core instructions they feed. A lab script for
the kernel notes in docs/kernels.md; it needs cuobjdump (the GPU image has it).
"""
import argparse
import collections
import json
import re
import subprocess
from pathlib import Path

from qerl_pipe.kernels import cuda_ext

CLASSES = {
    "integer": ("LOP3", "SHF", "PRMT", "IADD3", "IMAD", "LEA", "ISETP", "SEL", "IMNMX", "VIMNMX"),
    "bf16 multiply": ("HMUL2", "HFMA2"),
    "shared loads": ("LDS",),
    "async copies": ("LDGSTS",),
    "tensor": ("HGMMA", "HMMA"),
    "barriers": ("BAR", "WARPSYNC", "DEPBAR", "WARPGROUP"),
}


def counts(sass: str, pattern: str) -> dict[str, dict]:
    out = {}
    for block in re.split(r"\n\s*Function : ", sass)[1:]:
        name = block.split("\n", 1)[0].strip()
        if not re.search(pattern, name):
            continue
        ops = collections.Counter()
        for line in block.split("\n"):
            m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
            if m:
                ops[m.group(1)] += 1
        classes = {c: sum(n for op, n in ops.items() if op.startswith(prefixes)) for c, prefixes in CLASSES.items()}
        out[name] = {"instructions": sum(ops.values()), "classes": classes, "opcodes": dict(ops.most_common(25))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--filter", default="kernel")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    module = cuda_ext._module()
    sass = subprocess.run(["cuobjdump", "-sass", module.__file__], capture_output=True, text=True, check=True).stdout
    result = counts(sass, args.filter)
    for name, r in result.items():
        print(f"{r['instructions']:6d} {r['classes']} {name[:120]}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
