"""How our messages quote another library's error: its type and first line, never its whole text (a Dynamo,
gloo or NCCL message can run to pages)."""


def quoted(error: BaseException, limit: int = 300) -> str:
    """``"TypeName: first non-blank line"`` of ``error`` (the line cut at ``limit`` characters), or the type
    name alone where the error says nothing."""
    line = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {line[:limit]}" if line else type(error).__name__
