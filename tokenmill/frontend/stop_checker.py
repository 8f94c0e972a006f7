"""Stop strings: find them in freshly detokenized text, across token boundaries.

A stop string can start in an earlier token and end in the new one, or lie
inside a single token. Only the tail that the new characters could have
completed is searched:

    text:  "... The answer is 42.\\n\\nQ"      stop = "\\n\\nQ" (3 chars)
                                ^^^^^^  new chars + (3 - 1) older chars
"""

from __future__ import annotations


def find_stop_string(text: str, new_char_count: int, stop: list[str],
                     include_stop_str_in_output: bool) -> tuple[str, int] | None:
    """Find the earliest stop string that the last `new_char_count` chars completed.

    Args:
        text: the whole output text so far.
        new_char_count: how many chars at the end of `text` are new this step.
        stop: the stop strings (non-empty).
        include_stop_str_in_output: keep the stop string in the text.

    Returns:
        (matched stop string, length to truncate `text` to), or None. With
        several matches the one that starts first wins, so no text past the
        first stop is ever returned.
    """
    if not stop or new_char_count <= 0:
        return None
    best: tuple[int, str] | None = None
    for s in stop:
        # The match must end inside the new chars, so it starts at or after this.
        start = max(0, len(text) - new_char_count - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    return s, idx + len(s) if include_stop_str_in_output else idx


def stop_buffer_length(stop: list[str], include_stop_str_in_output: bool) -> int:
    """Chars to hold back while a request runs so a partial stop string is never streamed.

    A stop string of length L may have its first L - 1 chars already in the
    text; they may not be shown until the next tokens rule the stop out.
    When the stop string is kept in the output there is nothing to hide.
    """
    if not stop or include_stop_str_in_output:
        return 0
    return max(len(s) for s in stop) - 1
