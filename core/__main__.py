"""Allow ``python -m llmserve``."""

from llmserve.cli import main

if __name__ == "__main__":
    main()
