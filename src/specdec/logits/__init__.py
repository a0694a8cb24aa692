"""Request options that transform the target's logits from the history.

Every option here is a function of ``(prompt, tokens before this position, logits)``; the
engine applies it to every verify row with exactly the history plain decoding would have had
at that position (prompt + emitted + the drafts before the row), so speculation changes
nothing the request asked for.
"""
