"""Programmatic training prompts for draft distillation: chat, code, math, factual (the held-out kinds).

Built from templates x word lists with a seeded RNG; any prompt equal to (or containing) a held-out prompt
of scripts/prompts_heldout.json is dropped, so the held-out measurement stays honest.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HELDOUT = Path(__file__).resolve().parent / "prompts_heldout.json"

TOPICS = ["photosynthesis", "gravity", "inflation", "the water cycle", "machine learning", "the immune system",
          "volcanoes", "democracy", "black holes", "climate change", "the internet", "vaccines", "electricity",
          "plate tectonics", "the stock market", "recursion", "blockchain", "evolution", "the moon's phases",
          "supply and demand", "compound interest", "DNA", "rainbows", "earthquakes", "the Roman Empire",
          "sleep", "nutrition", "music theory", "quantum computing", "renewable energy", "tides", "magnets"]
ACTIVITIES = ["learning a new language", "staying focused at work", "saving money", "running a marathon",
              "cooking healthy meals", "writing clean code", "public speaking", "reducing stress", "traveling cheaply",
              "growing tomatoes", "making friends in a new city", "preparing for a job interview", "reading more books"]
FORMS = ["poem", "story", "haiku", "limerick", "letter", "song verse", "dialogue", "product description"]
SUBJECTS = ["a lighthouse", "autumn leaves", "a lost cat", "the first day of school", "a robot who learns to paint",
            "a quiet library", "the mountains in winter", "a busy train station", "friendship", "a thunderstorm"]
TASKS = ["reverse a string in Python", "center a div in CSS", "ask for a raise", "apologize to a friend",
         "set up a Python virtual environment", "write a good commit message", "start a vegetable garden",
         "back up my photos", "prepare for an exam", "change a flat tyre", "read a CSV file with pandas",
         "remove duplicates from a list in Python", "write a cover letter", "train a puppy to sit"]
PAIRS = [("a list", "a tuple"), ("weather", "climate"), ("a virus", "a bacterium"), ("RAM", "storage"),
         ("TCP", "UDP"), ("speed", "velocity"), ("a simile", "a metaphor"), ("an LLC", "a corporation"),
         ("mitosis", "meiosis"), ("stocks", "bonds"), ("Python", "JavaScript"), ("a crocodile", "an alligator")]
COUNTRIES = ["Japan", "Canada", "Brazil", "Kenya", "Italy", "Australia", "Egypt", "Norway", "India", "Mexico",
             "Germany", "Spain", "Chile", "Thailand", "Poland", "Peru"]
CHAT = ["Explain {topic} in simple terms.", "Give me {n} tips for {activity}.", "Write a short {form} about {subject}.",
        "How do I {task}?", "What is the difference between {a} and {b}?", "Summarize what {topic} is in two sentences.",
        "What is the capital of {country}?", "Why is {topic} important?", "List {n} facts about {topic}.",
        "Can you help me with {activity}? I keep struggling.", "Describe {subject} in a few vivid sentences."]
FUNCS = [("fibonacci", "n", "Return the n-th Fibonacci number."), ("count_vowels", "text", "Count the vowels in text."),
         ("flatten", "nested", "Flatten a list of lists into one list."), ("gcd", "a, b", "Greatest common divisor of a and b."),
         ("is_prime", "n", "Return True if n is a prime number."), ("word_count", "text", "Count words in a string."),
         ("merge_sorted", "a, b", "Merge two sorted lists into one sorted list."),
         ("celsius_to_fahrenheit", "c", "Convert a temperature from Celsius to Fahrenheit."),
         ("read_lines", "path", "Read a text file and return its lines without newlines."),
         ("chunk", "items, size", "Split items into lists of at most size elements."),
         ("unique", "items", "Return the items without duplicates, keeping their order."),
         ("mean", "values", "Return the arithmetic mean of a list of numbers."),
         ("transpose", "matrix", "Transpose a matrix given as a list of rows."),
         ("capitalize_words", "s", "Capitalize the first letter of every word in s.")]
CLASSES = [("Queue", "A FIFO queue backed by collections.deque."), ("Counter", "Count hashable items."),
           ("BankAccount", "A bank account with a balance and a transaction history."),
           ("Matrix", "A small dense matrix of floats."), ("LRUCache", "A least-recently-used cache of fixed size."),
           ("Point", "A point in the 2-D plane.")]
FACT_SUBJ = ["The Eiffel Tower is", "The Amazon rainforest is", "The Moon orbits the Earth", "Albert Einstein was",
             "The Pacific Ocean is", "Mount Everest is", "The printing press was invented", "Honey bees are",
             "The Roman Empire was", "Jupiter is the largest planet", "The Industrial Revolution began",
             "Penicillin was discovered", "The human brain", "Lightning is caused by", "The Sahara Desert",
             "Shakespeare wrote", "The speed of light is", "Antarctica is", "The Nile river", "Electric cars work by",
             "The first computers", "Coffee originated in", "The Olympic Games", "Earthquakes happen when"]
ITEMS = ["apples", "notebooks", "tickets", "marbles", "cookies", "stamps", "pens", "books"]


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 40), rng.randint(2, 20), rng.randint(2, 9)
    item = rng.choice(ITEMS)
    forms = [f"Question: Tom has {a} {item}. He buys {b} more and gives away {c}. How many {item} does he have now?\nAnswer:",
             f"Question: What is {rng.choice([5, 10, 20, 25, 30, 40, 75])}% of {rng.randint(2, 50) * 10}?\nAnswer:",
             f"Solve for x: {c}x + {a} = {c * b + a}.\nSolution:",
             f"Question: A car travels {a * 10} km in {c} hours. What is its average speed?\nAnswer:",
             f"Question: A box holds {b} {item}. How many {item} are in {c} boxes?\nAnswer:",
             f"The product of {a} and {b} is",
             f"Question: If a shirt costs ${a} and is discounted by {rng.choice([10, 20, 25, 50])}%, what is the new price?\nAnswer:",
             f"Question: What is the area of a rectangle {a} m long and {b} m wide?\nAnswer:"]
    return rng.choice(forms)


def _chat(rng: random.Random) -> str:
    a, b = rng.choice(PAIRS)
    return rng.choice(CHAT).format(topic=rng.choice(TOPICS), n=rng.choice([3, 4, 5]), activity=rng.choice(ACTIVITIES),
                                   form=rng.choice(FORMS), subject=rng.choice(SUBJECTS), task=rng.choice(TASKS),
                                   a=a, b=b, country=rng.choice(COUNTRIES))


def _code(rng: random.Random) -> str:
    if rng.random() < 0.7:
        name, args, doc = rng.choice(FUNCS)
        if rng.random() < 0.5:
            return f'def {name}({args}):\n    """{doc}"""\n'
        return f"# {doc}\ndef {name}({args}):\n"
    name, doc = rng.choice(CLASSES)
    return f'class {name}:\n    """{doc}"""\n\n    def __init__(self'


def train_texts(seed: int, n: int = 6000) -> list[tuple[str, bool]]:
    """n (text, is_chat) prompts (chat 40%, code 25%, math 20%, factual 15%), deterministic for the seed."""
    held = [p["text"] for p in json.loads(HELDOUT.read_text())["prompts"]]
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        r = rng.random()
        if r < 0.40:
            text, chat = _chat(rng), True
        elif r < 0.65:
            text, chat = _code(rng), False
        elif r < 0.85:
            text, chat = _math(rng), False
        else:
            text, chat = rng.choice(FACT_SUBJ), False
        if any(h in text or text in h for h in held):
            continue
        out.append((text, chat))
    return out


def train_prompts(tok, seed: int, n: int = 6000) -> list[list[int]]:
    """train_texts as token ids (chat prompts through the chat template)."""
    return encode(tok, train_texts(seed, n))


def encode(tok, texts: list[tuple[str, bool]]) -> list[list[int]]:
    """(text, is_chat) -> token ids (chat prompts through the chat template)."""
    out = []
    for text, chat in texts:
        if chat:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = tok(text, add_special_tokens=False)["input_ids"]
        out.append(ids)
    return out
