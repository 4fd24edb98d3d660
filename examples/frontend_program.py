"""SGLang frontend programs (``sgl.function`` + ``gen``, and a multi-turn chat) against a running server.

The programs know nothing about speculation: point them at a saguaro server and they run unchanged (and,
at temperature 0, produce exactly what a plain server produces; tests/test_serving_api.py checks that).

    python -m sglang_ssd.launch_cpu --model-path TARGET --speculative-algorithm saguaro \
        --speculative-draft-model-path DRAFT --port 30000 ...      # or sglang.launch_server on GPU
    python examples/frontend_program.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json

import sglang as sgl


@sgl.function
def study_tips(s, topic):
    """Completion-style program: a fixed scaffold with two generated slots, each stopped at a newline."""
    s += f"Two practical tips about {topic}:\n1."
    s += sgl.gen("tip1", max_tokens=32, stop="\n")
    s += "\n2."
    s += sgl.gen("tip2", max_tokens=32, stop="\n")


@sgl.function
def multi_turn_chat(s, first, second):
    """Chat program: the server-side chat template (chatml for SmolLM2) wraps each turn."""
    s += sgl.system("You are a concise, helpful assistant.")
    s += sgl.user(first)
    s += sgl.assistant(sgl.gen("answer1", max_tokens=48))
    s += sgl.user(second)
    s += sgl.assistant(sgl.gen("answer2", max_tokens=48))


def run_programs(url: str, temperature: float = 0.0) -> dict:
    """Run both programs against the server at url; returns the generated variables."""
    backend = sgl.RuntimeEndpoint(url, chat_template_name="chatml")
    tips = study_tips.run(topic="learning to cook", temperature=temperature, backend=backend)
    chat = multi_turn_chat.run(first="What is the capital of Italy?",
                               second="Name one famous building in that city.",
                               temperature=temperature, backend=backend)
    return {"tip1": tips["tip1"], "tip2": tips["tip2"], "answer1": chat["answer1"], "answer2": chat["answer2"],
            "chat_text": chat.text()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args(argv)
    print(json.dumps(run_programs(args.url, args.temperature), indent=1))


if __name__ == "__main__":
    main()
