"""examples/ep_trl_grpo.py with completions that do not depend on the number of processes:
`GRPOTrainer._generate_single_turn` replaced by a function of the prompt and of its
copy's index among the copies of that prompt in the call (each prompt's num_generations
copies are generated together, on one rank), so one process and two generate the same
completions, and the losses, gradient norms and weights can be compared.

    python _grpo_fixed_completions.py ARGS          # ARGS: ep_trl_grpo.py's
"""

import runpy
import sys
from pathlib import Path

from trl import GRPOTrainer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def fixed_completions(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kw):
    """Four tokens t3..t102 per completion, from the prompt's ids and the copy's index."""
    seen: dict[tuple, int] = {}
    out = []
    for ids in prompt_ids:
        k = seen.get(tuple(ids), 0)
        seen[tuple(ids)] = k + 1
        out.append([3 + (7 * sum(ids) + 13 * k + 5 * j + k * j) % 100 for j in range(4)])
    return out, None


if __name__ == "__main__":
    GRPOTrainer._generate_single_turn = fixed_completions
    sys.path.insert(0, str(EXAMPLES))
    sys.argv = [str(EXAMPLES / "ep_trl_grpo.py"), *sys.argv[1:]]
    runpy.run_path(str(EXAMPLES / "ep_trl_grpo.py"), run_name="__main__")
