"""A GEMM-candidate compile worker (`python -m eagle3_build.backends.cpu.gemm_worker PARENT_PID`): compiles the
blocked candidates gemm.compile_candidates sends it, one JSON task per stdin line, answering each with one line
`eagle3-gemm <id> <json>` on stdout ({"ok": package path} or {"error": why})."""
from __future__ import annotations

import json
import sys
import traceback


def main(parent: int) -> None:
    from ..worker import die_with_parent

    die_with_parent(parent)
    import torch

    from . import gemm
    from . import inductor_internals as inductor

    inductor.warm_up()
    for line in sys.stdin:
        task = json.loads(line)
        try:
            torch.set_num_threads(task["threads"])
            with inductor.config_patch({"cpp.simdlen": task["simdlen"], "cpp.march": task["march"]}):
                gemm.compile_pass([tuple(s) for s in task["shapes"]], task["rows"], task["candidate"],
                                  task["threads"], task["out"])
            answer = {"ok": task["out"]}
        except Exception as e:
            traceback.print_exc()
            answer = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(f"{gemm.MARK} {task['id']} {json.dumps(answer)}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
