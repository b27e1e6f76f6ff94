"""The reward of configs/reinforce_tiny.yml: how much of the target word a completion spells.

A verifiable task a tiny model learns from scratch on a CPU: every prompt asks for the word
"neox", then the end of the text. A completion earns a fifth for each of the word's four
letters in its place and a fifth for ending right after them (the end-of-text token is not in
the completion's text: a completion that ends is one whose text stops there), so its reward
is in [0, 1] and 1 means exactly "neox".
"""

TARGET = "neox"


def spell_neox(prompts: list[str], completions: list[str]) -> list[float]:
    rewards = []
    for text in completions:
        letters = sum(1 for i, ch in enumerate(TARGET) if i < len(text) and text[i] == ch)
        ends = len(text) == len(TARGET)
        rewards.append((letters + ends) / (len(TARGET) + 1))
    return rewards
