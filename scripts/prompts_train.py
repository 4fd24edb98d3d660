"""Programmatic training prompts for draft distillation: chat, code, math, factual (the held-out kinds).

Built from templates x word lists with a seeded RNG; any prompt equal to (or containing) a held-out prompt
of scripts/prompts_heldout.json is dropped, so the held-out measurement stays honest.
"""

from __future__ import annotations

import functools
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


# ------------------------------------------------------------------------------------------- diverse pool
# The template pool above has a few hundred distinct prompts (24 factual openings, 14 functions, ...): five
# passes over it gave the 2M positions of assets/gen, and the held-out alpha stayed flat while the in-pool loss
# fell (results/draft_finetune5.md).  The diverse pool draws its slots from much larger lists that are on every
# machine: whole-word tokens of the target's own vocabulary (topics, names) and the Python standard library's
# documented functions and classes (code prompts in the held-out style: signature + docstring).
CHAT2 = CHAT + ["What is {word}?", "Tell me something interesting about {word}.", "Explain how {word} works.",
                "Write a short {form} about {word}.", "What are the pros and cons of {word}?",
                "How would you describe {word} to a child?", "Give me {n} ideas related to {word}.",
                "What should I know before I start with {word}?", "Why do people care about {word}?",
                "Is {word} good or bad? Explain briefly.", "Write a haiku about {word}.",
                "How do I get better at {activity}?", "Compare {word} and {word2} in a few sentences.",
                "What is the history of {name}?", "Where is {name} and what is it known for?"]
FACT2 = ["{Name} is", "{Name} was", "{Name} is known for", "The history of {name} began", "In {name},",
         "The word \"{word}\" means", "A {word} is", "Most people think of {word} as", "{Name} became famous"]


def vocab_words(tok) -> tuple[list[str], list[str]]:
    """(lower-case words, capitalised names): whole-word tokens of the tokenizer's vocabulary, >= 5 letters."""
    low, cap = set(), set()
    for piece in tok.get_vocab():
        if not piece.startswith("\u0120"):  # byte-level BPE: a leading space
            continue
        w = piece[1:]
        if len(w) >= 5 and w.isascii() and w.isalpha():
            (low if w.islower() else cap if w[0].isupper() and w[1:].islower() else set()).add(w)
    return sorted(low), sorted(cap)


@functools.lru_cache(maxsize=2)
def stdlib_defs(limit: int = 20000) -> list[tuple[str, str, str]]:
    """(kind, signature, first docstring line) of documented top-level functions / classes in the stdlib."""
    import ast
    import sysconfig
    out = []
    root = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in f.parts[-2:][0] or f.name.startswith("test"):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            doc = ast.get_docstring(node) if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None
            if not doc or node.name.startswith("_"):
                continue
            line = doc.strip().splitlines()[0].strip()
            if not 10 <= len(line) <= 100:
                continue
            if isinstance(node, ast.FunctionDef):
                args = ", ".join(a.arg for a in node.args.args)
                out.append(("def", f"def {node.name}({args}):", line))
            else:
                out.append(("class", f"class {node.name}:", line))
            if len(out) >= limit:
                return out
    return out


def _math2(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 60), rng.randint(2, 12)
    item, name = rng.choice(ITEMS + ["eggs", "bottles", "chairs", "coins", "cards", "shirts"]), rng.choice(
        ["Tom", "Anna", "Ravi", "Mei", "Lucas", "Sara", "Omar", "Julia"])
    forms = [f"Question: {name} has {a} {item}. {name} gives {c} to each of {b % 5 + 2} friends. How many are left?\nAnswer:",
             f"Question: What is {a} + {b} * {c}?\nAnswer:", f"Question: What is {a * c} divided by {c}?\nAnswer:",
             f"Solve for x: {c}x - {b} = {c * a - b}.\nSolution:", f"The sum of the first {a} positive integers is",
             f"Question: A train travels {a * c} km in {c} hours. What is its average speed in km/h?\nAnswer:",
             f"Question: Convert {a} kilometres to metres.\nAnswer:", f"Question: What is {a}% of {b * 10}?\nAnswer:",
             f"Question: A rectangle is {a} cm long and {b} cm wide. What is its perimeter?\nAnswer:",
             f"Question: {name} reads {c} pages a day. How many pages in {b} days?\nAnswer:",
             f"Question: What is the average of {a}, {b} and {c}?\nAnswer:", f"{a} times {c} equals",
             f"Question: If {c} {item} cost ${a}, how much do {c * 3} {item} cost?\nAnswer:"]
    return rng.choice(forms)


def diverse_texts(tok, seed: int, n: int = 20000) -> list[tuple[str, bool]]:
    """n (text, is_chat) prompts of the four kinds (chat 40%, code 25%, math 20%, factual 15%) with slots drawn
    from vocab_words and stdlib_defs; none contains (or is contained in) a held-out prompt."""
    held = [p["text"] for p in json.loads(HELDOUT.read_text())["prompts"]]
    low, cap = vocab_words(tok)
    defs = stdlib_defs()
    topics, subjects, countries = TOPICS + low, SUBJECTS + low, COUNTRIES + cap  # the slots' lists, made once
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        r = rng.random()
        w, w2, name = rng.choice(low), rng.choice(low), rng.choice(cap)
        if r < 0.40:
            a, b = rng.choice(PAIRS)
            text, chat = rng.choice(CHAT2).format(
                topic=rng.choice(topics), n=rng.choice([3, 4, 5]), activity=rng.choice(ACTIVITIES),
                form=rng.choice(FORMS), subject=rng.choice(subjects), task=rng.choice(TASKS), a=a, b=b,
                country=rng.choice(countries), word=w, word2=w2, name=name), True
        elif r < 0.65:
            kind, sig, doc = rng.choice(defs)
            if kind == "class":
                text = f'{sig}\n    """{doc}"""\n\n    def __init__(self'
            else:
                text = f'{sig}\n    """{doc}"""\n' if rng.random() < 0.6 else f"# {doc}\n{sig}\n"
            chat = False
        elif r < 0.85:
            text, chat = _math2(rng), False
        else:
            text, chat = rng.choice(FACT2).format(Name=name, name=name, word=w), False
        if any(h in text or text in h for h in held):
            continue
        out.append((text, chat))
    return out


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


# ------------------------------------------------------------------------------------------ second diverse pool
# The first diverse pool is used up (results/draft_finetune7.md) and chat (0.36) and factual (0.39) stayed the
# weakest kinds: its chat slots were single vocabulary words ("What is crumbling?"), far from the held-out style.
# The second pool is phrased like the held-out prompts: natural questions and requests over hand-written noun
# phrases, factual openings that start an explanation, stdlib methods (not only top-level functions) with their
# type hints, and more math forms.  Weights lean to the weak kinds: chat 45%, factual 25%, code 20%, math 10%.
NOUNS2 = TOPICS + [
    "the heart", "the lungs", "bacteria", "a rainbow", "the Sun", "the ocean", "a hurricane", "a tornado", "glaciers",
    "the Moon", "Mars", "the Milky Way", "a solar eclipse", "the ozone layer", "coral reefs", "rainforests", "deserts",
    "the printing press", "the steam engine", "the telephone", "the light bulb", "the airplane", "antibiotics",
    "the French Revolution", "the Renaissance", "the Cold War", "ancient Egypt", "the Silk Road", "the Olympic Games",
    "the United Nations", "the Great Depression", "the Industrial Revolution", "World War I", "the Internet",
    "a credit score", "a mortgage", "taxes", "a budget", "interest rates", "a recession", "cryptocurrency",
    "meditation", "exercise", "caffeine", "vitamins", "the common cold", "allergies", "a balanced diet",
    "a neural network", "a database", "an operating system", "a compiler", "encryption", "a web browser", "the cloud",
    "Git", "Linux", "an API", "a hash table", "sorting algorithms", "object-oriented programming", "unit tests",
    "a haiku", "a sonnet", "jazz", "the violin", "photography", "oil painting", "chess", "yoga", "gardening",
    "the periodic table", "atoms", "chemical reactions", "acids and bases", "friction", "sound waves", "light",
    "magnetism", "the speed of sound", "energy", "nuclear power", "solar panels", "wind turbines", "batteries"]
TASKS2 = TASKS + [
    "make a good first impression", "write a thank-you note", "fix a slow computer", "learn to touch type",
    "plan a birthday party", "negotiate a lower rent", "stay motivated while studying", "fall asleep faster",
    "make my code easier to read", "sort a dictionary by value in Python", "write a for loop in JavaScript",
    "keep a plant alive indoors", "make a simple budget", "boil an egg", "say no without feeling guilty",
    "give feedback to a coworker", "organize my email inbox", "prepare for a long flight", "start running",
    "write a short bio for my website", "explain my job to my grandparents", "choose a laptop", "learn to cook rice",
    "deal with a difficult customer", "memorize a speech", "make new habits stick", "read a scientific paper"]
CHAT3 = ["What is {noun}?", "Explain {noun} to a ten-year-old.", "How does {noun} work?", "Why is {noun} important?",
         "Give me {n} tips to {task}.", "How do I {task}?", "What is the best way to {task}?",
         "Can you explain {noun} in simple words?", "Write a short poem about {noun}.",
         "Write a short story about {subject}.", "Tell me {n} interesting facts about {noun}.",
         "What are the main causes of {noun}?", "What is the difference between {noun} and {noun2}?",
         "Summarize the history of {noun} in a few sentences.", "What would happen without {noun}?",
         "I want to {task}. Where should I start?", "What are common mistakes people make when they {task}?",
         "Describe {subject} in three sentences.", "Give me a step-by-step plan to {task}.",
         "Is it hard to {task}?", "What do scientists know about {noun}?", "Write a limerick about {noun}.",
         "What is the capital of {country}?", "What language is spoken in {country}?",
         "Recommend {n} books about {noun}.", "Explain the pros and cons of {noun}.",
         "My friend asked me about {noun}. How should I explain it?", "What does {noun} have to do with everyday life?"]
FACT3 = ["{Noun} is", "{Noun} is a", "{Noun} is important because", "{Noun} works by", "{Noun} was first",
         "The main idea behind {noun} is that", "Scientists study {noun} because", "The history of {noun} began",
         "One interesting fact about {noun} is that", "{Noun} can be explained as", "There are three things to know "
         "about {noun}:", "The capital of {country} is", "{country} is a country", "Most people know that {noun}"]


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


@functools.lru_cache(maxsize=2)
def stdlib_methods(limit: int = 30000) -> list[tuple[str, str]]:
    """(code prefix, kind) from the stdlib: documented methods inside their class, and documented functions with
    their annotations and a module import line above, each ending where the body starts."""
    import ast
    import sysconfig
    out = []
    root = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if f.name.startswith("test") or "test" in f.parent.name or not f.parent.name.isidentifier():
            continue  # tests, and site-packages (not the stdlib)
        try:
            tree = ast.parse(f.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        mod = f.stem if f.parent == root else f"{f.parent.name}.{f.stem}"
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and ast.get_docstring(node) and not node.name.startswith("_"):
                cdoc = ast.get_docstring(node).strip().splitlines()[0].strip()
                for m in node.body:
                    doc = ast.get_docstring(m) if isinstance(m, ast.FunctionDef) else None
                    if doc and not m.name.startswith("_") and 10 <= len(doc.splitlines()[0].strip()) <= 100:
                        out.append((f'class {node.name}:\n    """{cdoc[:100]}"""\n\n    def {m.name}'
                                    f'({ast.unparse(m.args)}):\n        """{doc.strip().splitlines()[0].strip()}"""\n',
                                    "method"))
            elif isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and not node.name.startswith("_"):
                line = ast.get_docstring(node).strip().splitlines()[0].strip()
                if 10 <= len(line) <= 100:
                    ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
                    out.append((f"import {mod.split('.')[0]}\n\n\ndef {node.name}({ast.unparse(node.args)}){ret}:\n"
                                f'    """{line}"""\n', "function"))
            if len(out) >= limit:
                return out
    return out


def _math3(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 40), rng.randint(2, 9)
    forms = [f"Question: A shop sells {rng.choice(ITEMS)} at {c} for ${b}. How much do {c * a} cost?\nAnswer:",
             f"Question: What is {c * 5}% of {b * 20}?\nAnswer:", f"Solve for x: {c}x + {b} = {c * a + b}.\nSolution:",
             f"Question: A car travels {a * c} km in {c * 15} minutes. What is its average speed in km/h?\nAnswer:",
             f"The sum of the first {a} even numbers is", f"Question: What is {a} squared?\nAnswer:",
             f"Question: A circle has a radius of {c} cm. What is its area?\nAnswer:",
             f"Question: What is 1/{c} + 1/{c + 1}?\nAnswer:", f"Question: A price rises from ${a} to ${a + b}. "
             f"By what percent did it increase?\nAnswer:", f"Question: How many minutes are in {c} hours?\nAnswer:",
             f"Question: {a} students share {a * c} pencils equally. How many does each get?\nAnswer:"]
    return rng.choice(forms) if rng.random() < 0.6 else _math2(rng)


def diverse2_texts(tok, seed: int, n: int = 12000) -> list[tuple[str, bool]]:
    """n (text, is_chat) prompts of the second diverse pool (see above); none contains (or is contained in) a
    held-out or benchmark prompt (scripts/prompts_bench.json: "Mars is" would be inside one of them)."""
    held = [p["text"].strip() for f in (HELDOUT, HELDOUT.with_name("prompts_bench.json"))
            for p in json.loads(f.read_text())["prompts"]]
    defs = stdlib_methods()
    subjects = SUBJECTS + [f"{a} {b}" for a in ("an old", "a tiny", "a brave", "a forgotten", "a noisy")
                           for b in ("robot", "garden", "city", "boat", "teacher", "dragon", "bakery", "island")]
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        r = rng.random()
        noun, noun2 = rng.choice(NOUNS2), rng.choice(NOUNS2)
        if r < 0.45:
            text = rng.choice(CHAT3).format(noun=noun, noun2=noun2, n=rng.choice([3, 4, 5]), task=rng.choice(TASKS2),
                                            subject=rng.choice(subjects), country=rng.choice(COUNTRIES))
            chat = True
        elif r < 0.70:
            text, chat = rng.choice(FACT3).format(Noun=_cap(noun), noun=noun, country=rng.choice(COUNTRIES)), False
        elif r < 0.90:
            text, chat = rng.choice(defs)[0], False
        else:
            text, chat = _math3(rng), False
        if text in seen:  # each prompt once (the factual and code lists run out first; chat and math fill in)
            continue
        if any(h in text or text in h for h in held):
            continue
        seen.add(text)
        out.append((text, chat))
    return out
