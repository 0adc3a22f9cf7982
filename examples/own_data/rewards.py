"""Two reward functions over examples/own_data's columns, as TRL takes them: each gets the
prompts, the completions and every other column by name, and returns one float each."""


def correct(prompts, completions, answer, **kwargs):
    """1 for the right sum on the first line, else 0."""
    return [float(c.split("\n", 1)[0].strip() == str(a)) for c, a in zip(completions, answer)]


def concise(prompts, completions, **kwargs):
    """-0.1 per character past the answer's line: say the sum, then stop."""
    return [-0.1 * len(c.split("\n", 1)[1]) if "\n" in c else 0.0 for c in completions]
