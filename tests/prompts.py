"""Prompts used by the server tests (varied: chat, code, math, facts, plain continuation)."""

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


def chat_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def all_prompt_ids(tokenizer) -> list[list[int]]:
    return [chat_ids(tokenizer, p) for p in CHAT] + [tokenizer(p)["input_ids"] for p in RAW]
