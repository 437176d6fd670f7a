"""What the grammar engine raises. Plain domain errors like the engine's
(engine/errors.py): api/status.py maps ConstraintRejected to INVALID_ARGUMENT."""

from __future__ import annotations


class ConstraintRejected(ValueError):
    """A structured-output constraint that can never be served: it does not
    parse, does not compile, or takes longer than the bound to compile. Same
    shape as planning's RequestRejected: `field` names the request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class TokenRejected(ValueError):
    """A token the grammar does not allow at this point was offered to a
    matcher; the matcher is left as it was."""

    def __init__(self, token_id: int, position: int) -> None:
        super().__init__(f"token {token_id} is not allowed by the grammar after {position} tokens")
        self.token_id = token_id
        self.position = position


class GrammarFailed(RuntimeError):
    """A matcher hit one of llguidance's limits mid-output (lexer or parser too
    complex for this text): it stays failed and its request ends with an error."""
