"""How the demo model behaves on everyday questions: replies that loop to the token cap, and answers
in another language than the question's, for the cpu profile and variants of it.

Each question starts from an empty chat (`/undo` after each); each variant runs with several seeds.
20 questions in English, 6 in French, Spanish and German, then a 3-turn chat in English about
foreign capitals. A reply loops when it stops at the token
cap with a 4-word sequence repeated 3 times or more; its language is the one (English, French,
Spanish, German) whose common function words it uses most.

usage: python scripts/demo_behaviour.py [--seeds 3] [--variant NAME ...]   (JSON on stdout)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

QUESTIONS = [("en", q) for q in (
    "What is a good way to start learning to cook?", "How do I keep houseplants alive?",
    "Can you explain what a budget is?", "What should I pack for a weekend trip?",
    "How can I sleep better at night?", "What is the difference between weather and climate?",
    "Give me three ideas for a rainy afternoon.", "How do I write a polite email to my landlord?",
    "What makes bread rise?", "How often should I water tomatoes?", "What is compound interest?",
    "How can I remember names better?", "What are some easy exercises I can do at home?",
    "Why is the sky blue?", "How do I make a cup of tea?", "What should I look for when buying a used bike?",
    "How do I start a journal?", "What is a healthy breakfast?", "How can I save money on groceries?",
    "What is the capital of Australia?",
)] + [
    ("fr", "Comment puis-je mieux dormir la nuit ?"), ("fr", "Qu'est-ce qui fait lever le pain ?"),
    ("es", "¿Cómo puedo ahorrar dinero en el supermercado?"), ("es", "¿Por qué el cielo es azul?"),
    ("de", "Wie mache ich eine gute Tasse Tee?"), ("de", "Was ist der Unterschied zwischen Wetter und Klima?"),
]
# a short chat in English whose follow-ups name foreign places: where the demo model drifted into French
FOLLOW_UPS = [["What is the capital of France?", "And of Germany?", "And of Spain?"]]
FUNCTION_WORDS = {
    "en": {"the", "is", "and", "to", "of", "you", "it", "in", "that", "for", "your", "are", "with", "can"},
    "fr": {"le", "la", "les", "est", "et", "des", "une", "du", "vous", "pour", "que", "dans", "pas", "sur"},
    "es": {"el", "los", "las", "es", "y", "una", "por", "con", "que", "para", "del", "en", "su", "como"},
    "de": {"der", "die", "das", "und", "ist", "nicht", "ein", "eine", "zu", "mit", "sie", "den", "von", "auf"},
}
THREADS = int(os.environ.get("BEHAVIOUR_THREADS", "1"))  # one: the machine stays usable meanwhile
NONE = 'system: ""\n'  # the template's own system prompt, not the demo model's default
VARIANTS = {
    "before (no penalty, template system prompt)": "extends: cpu\n" + NONE + "repeat_penalty: 1.0\ndry_multiplier: 0\n",
    "repeat penalty 1.1": "extends: cpu\n" + NONE + "repeat_penalty: 1.1\ndry_multiplier: 0\n",
    "DRY 0.8": "extends: cpu\n" + NONE + "repeat_penalty: 1.0\ndry_multiplier: 0.8\n",
    "repeat penalty 1.15": "extends: cpu\n" + NONE + "repeat_penalty: 1.15\ndry_multiplier: 0\n",
    "repeat penalty 1.1 + DRY 0.8": "extends: cpu\n" + NONE + "repeat_penalty: 1.1\ndry_multiplier: 0.8\n",
    "repeat penalty 1.1, system: reply in English unless": "extends: cpu\nsystem: \"You are a helpful assistant. "
    "Reply in English unless the user writes in another language.\"\n",
    "repeat penalty 1.1, system: answer briefly": "extends: cpu\nsystem: \"You are a helpful assistant. "
    "Answer briefly.\"\n",
    "shipped cpu profile": "extends: cpu\n",
}


def loops(text: str) -> bool:
    words = re.findall(r"\w+", text.lower())
    grams = Counter(tuple(words[i:i + 4]) for i in range(len(words) - 3))
    return bool(grams) and max(grams.values()) >= 3


def language(text: str) -> str:
    """The language whose common function words the text uses most ("?" with fewer than 3 of any)."""
    words = re.findall(r"[^\W\d_]+", text.lower())
    counts = {lang: sum(w in common for w in words) for lang, common in FUNCTION_WORDS.items()}
    best = max(counts, key=lambda lang: counts[lang])
    return best if counts[best] >= 3 else "?"


def run(profile_text: str, seed: int, home: str, chats_only: bool = False) -> list[dict]:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(profile_text)
    session = f"b{abs(hash(profile_text)) % 10**8}-{seed}"
    stats = Path(home) / f"{session}.jsonl"
    singles = [] if chats_only else QUESTIONS
    lines = "".join(q + "\n/undo\n" for _, q in singles) + "".join("\n".join(c) + "\n" for c in FOLLOW_UPS)
    asked = singles + [("en+", q) for chat in FOLLOW_UPS for q in chat]  # en+: a turn of a chat
    subprocess.run([sys.executable, "-m", "localchat", "--profile", f.name, "--seed", str(seed), "--session", session,
                    "--stats-json", str(stats), "--threads", str(THREADS)], input=lines, capture_output=True, text=True,
                   env={**os.environ, "LOCALCHAT_HOME": home}, timeout=1800, check=True)
    os.unlink(f.name)
    records = [json.loads(x) for x in (Path(home) / "sessions" / session / "transcript.jsonl").read_text().splitlines()]
    replies = [r["content"] for r in records if r.get("t") == "msg" and r["role"] == "assistant"]
    turns = [json.loads(x) for x in stats.read_text().splitlines()]
    return [{"question": q, "reply": text[:300], "stop": st["stop_reason"], "tokens": st["reply_tokens"],
             "loops": st["stop_reason"] == "max_tokens" and loops(text), "asked_in": lang,
             "wrong_language": language(text) not in (lang.rstrip("+"), "?")}
            for (lang, q), text, st in zip(asked, replies, turns)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--variant", nargs="*", default=list(VARIANTS))
    p.add_argument("--chats-only", action="store_true", help="only the chat in English, not the single questions")
    args = p.parse_args()
    home = tempfile.mkdtemp(prefix="lc-behave-")
    out = {}
    for name in args.variant:
        rows = [row for seed in range(1, args.seeds + 1) for row in run(VARIANTS[name], seed, home, args.chats_only)]
        out[name] = {"replies": len(rows), "looping_to_the_cap": sum(r["loops"] for r in rows),
                     "wrong_language": sum(r["wrong_language"] for r in rows),
                     "wrong_language_of_english": sum(r["wrong_language"] for r in rows if r["asked_in"] == "en"),
                     "wrong_language_in_chats": sum(r["wrong_language"] for r in rows if r["asked_in"] == "en+"),
                     "at_the_cap": sum(r["stop"] == "max_tokens" for r in rows),
                     "examples": [r for r in rows if r["loops"] or r["wrong_language"]][:4]}
        print(f"{name}: {out[name]['looping_to_the_cap']} looping, {out[name]['wrong_language']} in another "
              f"language than the question's ({out[name]['wrong_language_of_english']} of English ones, "
              f"{out[name]['wrong_language_in_chats']} in English chats), "
              f"of {len(rows)}", file=sys.stderr)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
