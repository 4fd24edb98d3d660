"""Prompts used by the server tests (varied: chat, code, math, facts, plain continuation)."""

from sglang_ssd.demo import chat_prompt

CHAT = [
    "Give me three tips for studying effectively.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "How do I make a cup of tea?",
    "What are the primary colors?",
    "Write a Python function that returns the factorial of n.",
    "What is 17 times 23?",
    "Name three planets in our solar system.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]

RAW = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: If a train travels 60 miles in 1.5 hours, what is its average speed?\nA:",
    "Once upon a time, in a small village by the mountains,",
    "import numpy as np\n\n# compute the mean of a list\n",
    "The three laws of motion formulated by Isaac Newton are",
    "Water boils at",
    "A list of common fruits: apple, banana,",
]


def all_prompt_ids(tokenizer) -> list[list[int]]:
    return [chat_prompt(tokenizer, p) for p in CHAT] + [tokenizer(p)["input_ids"] for p in RAW]
