"""The diverse generation pools for draft distillation (draft_data --prompts diverse / diverse2 / diverse3).

The template pool of prompts_train.py has a few hundred distinct prompts; each pool here draws its slots from
larger lists and is answered by the target once (scripts/draft_data.py, jobs numbered from 100000 / 200000 /
300000).  No prompt contains (or is contained in) a held-out prompt; from the second pool on none is inside a
benchmark prompt either, and from the third on none repeats an earlier pool's prompt.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

from prompts_train import (ACTIVITIES, CHAT, COUNTRIES, FORMS, HELDOUT, ITEMS, PAIRS, SUBJECTS, TASKS,
                           TOPICS)

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


def _module_defs(tree, mod: str) -> list[tuple[str, str]]:
    """(code prefix, kind) of one parsed module: documented methods inside their (documented) class, and
    documented functions with their annotations and the module's import line above, each ending where the body
    starts; private names and docstrings whose first line is not 10-100 characters are left out."""
    import ast
    out = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and (ast.get_docstring(node) or "").strip() and not node.name.startswith("_"):
            cdoc = ast.get_docstring(node).strip().splitlines()[0].strip()
            for m in node.body:
                doc = ast.get_docstring(m) if isinstance(m, ast.FunctionDef) else None
                if doc and doc.strip() and not m.name.startswith("_") and 10 <= len(doc.splitlines()[0].strip()) <= 100:
                    out.append((f'class {node.name}:\n    """{cdoc[:100]}"""\n\n    def {m.name}'
                                f'({ast.unparse(m.args)}):\n        """{doc.strip().splitlines()[0].strip()}"""\n',
                                "method"))
        elif isinstance(node, ast.FunctionDef) and (ast.get_docstring(node) or "").strip() and not node.name.startswith("_"):
            line = ast.get_docstring(node).strip().splitlines()[0].strip()
            if 10 <= len(line) <= 100:
                ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
                out.append((f"import {mod.split('.')[0]}\n\n\ndef {node.name}({ast.unparse(node.args)}){ret}:\n"
                            f'    """{line}"""\n', "function"))
    return out


def _parse(f: Path):
    import ast
    try:
        return ast.parse(f.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return None


@functools.lru_cache(maxsize=2)
def stdlib_methods(limit: int = 30000) -> list[tuple[str, str]]:
    """_module_defs over the stdlib's top-level modules and packages (the second pool's code prompts)."""
    import sysconfig
    out = []
    root = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if f.name.startswith("test") or "test" in f.parent.name or not f.parent.name.isidentifier():
            continue  # tests, and site-packages (not the stdlib)
        tree = _parse(f)
        if tree is not None:
            out += _module_defs(tree, f.stem if f.parent == root else f"{f.parent.name}.{f.stem}")
        if len(out) >= limit:
            return out[:limit]
    return out


@functools.lru_cache(maxsize=2)
def package_defs(packages: tuple[str, ...] = ("numpy", "transformers"), limit: int = 12000) -> list[tuple[str, str]]:
    """_module_defs over installed packages (the third pool's code prompts; their versions are pinned by
    scripts/constraints-cpu.txt, so every machine set up by setup.sh draws the same list)."""
    import importlib.util
    out = []
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(list(spec.submodule_search_locations)[0])
        for f in sorted(root.rglob("*.py")):
            if any(p.startswith("test") for p in f.relative_to(root).parts):
                continue
            tree = _parse(f)
            if tree is not None:
                out += _module_defs(tree, pkg)
            if len(out) >= limit:
                return out[:limit]
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


# ------------------------------------------------------------------------------------------- third diverse pool
# The second pool moved every kind (results/draft_finetune8.md) but chat least (0.356 -> 0.371).  The third widens
# the chat and factual slots (everyday nouns: animals, food, places, jobs, hobbies, the body, weather, tools) and
# varies how a request is phrased (a greeting before it, a length or style wish after it), takes its code prompts
# from installed packages' documented functions and methods (numpy, transformers) and repeats no prompt of the
# first two pools.  Draws: chat 50%, factual 20%, code 20%, math 10%.
NOUNS3 = [
    "cats", "dogs", "elephants", "dolphins", "owls", "bees", "ants", "penguins", "sharks", "wolves", "octopuses",
    "bread", "cheese", "chocolate", "coffee beans", "rice", "pasta", "olive oil", "spices", "tea", "sourdough",
    "Paris", "Tokyo", "the Alps", "the Amazon river", "Iceland", "New York City", "the Sahara", "Venice", "the Arctic",
    "nurses", "firefighters", "architects", "pilots", "farmers", "librarians", "electricians", "software engineers",
    "knitting", "rock climbing", "birdwatching", "baking", "cycling", "painting", "podcasting", "board games",
    "the liver", "the skin", "bones", "muscles", "the eyes", "blood", "the stomach", "the brain's memory",
    "fog", "snow", "lightning", "humidity", "monsoons", "droughts", "the seasons", "a heat wave",
    "a hammer", "a microscope", "a compass", "a thermometer", "a bicycle", "a refrigerator", "a clock", "a telescope",
    "the wheel", "paper", "glass", "concrete", "plastic", "steel", "cotton", "rubber", "the alphabet", "money",
    "a spreadsheet", "a password manager", "email", "a smartphone", "Wi-Fi", "a search engine", "a video game"]
CHAT4 = ["What is {noun}?", "How does {noun} work?", "Tell me about {noun}.", "Why are {noun} important?",
         "What are {n} fun facts about {noun}?", "Explain {noun} like I'm five.", "Write a short poem about {noun}.",
         "Write a haiku about {noun}.", "Write a four-line story about {noun}.", "What is the history of {noun}?",
         "How do {noun} affect our daily lives?", "Describe {noun} in three sentences.",
         "What should a beginner know about {noun}?", "Compare {noun} and {noun2}.", "How do I {task}?",
         "Give me {n} tips to {task}.", "What is a good way to {task}?", "Can you help me {task}?"]
PREFIXES = ["", "", "Hi! ", "Quick question: ", "I'm curious. ", "Hello, ", "Please help: "]
SUFFIXES = ["", "", " Keep it short.", " Use simple words.", " Answer in two sentences.", " Give an example.",
            " Explain step by step.", " Be concise."]
FACT4 = ["{Noun} are", "{Noun} is", "{Noun} can", "Most {noun} live", "The main job of {noun} is",
         "A surprising fact about {noun} is that", "People have used {noun} since", "{Noun} were first",
         "In short, {noun}", "To understand {noun}, you need to know that", "The word for {noun} comes from"]


def diverse3_texts(tok, seed: int, n: int = 12000) -> list[tuple[str, bool]]:
    """n (text, is_chat) prompts of the third diverse pool (see above); none contains (or is contained in) a
    held-out or benchmark prompt, and none is a prompt of the first two pools (seed 0, their full lengths)."""
    held = [p["text"].strip() for f in (HELDOUT, HELDOUT.with_name("prompts_bench.json"))
            for p in json.loads(f.read_text())["prompts"]]
    defs = package_defs()
    from prompts_train import TASKS
    nouns, tasks = NOUNS3 + NOUNS2, TASKS2 + [t for t in TASKS if t not in TASKS2]
    seen = {t for t, _ in diverse_texts(tok, 0)} | {t for t, _ in diverse2_texts(tok, 0)}
    rng = random.Random(seed)
    out, tries = [], 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        r = rng.random()
        noun, noun2 = rng.choice(nouns), rng.choice(nouns)
        if r < 0.50:
            text = rng.choice(PREFIXES) + rng.choice(CHAT4).format(
                noun=noun, noun2=noun2, n=rng.choice([3, 4, 5]), task=rng.choice(tasks)) + rng.choice(SUFFIXES)
            chat = True
        elif r < 0.70:
            text, chat = rng.choice(FACT4).format(Noun=_cap(noun), noun=noun), False
        elif r < 0.90:
            text, chat = rng.choice(defs)[0], False
        else:
            text, chat = _math3(rng), False
        if text in seen or any(h in text or text in h for h in held):
            continue
        seen.add(text)
        out.append((text, chat))
    return out
