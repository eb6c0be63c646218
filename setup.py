"""Map the design card's folders onto import names: core/ -> llmserve, plugins/ -> llmserve.plugins."""
from setuptools import find_packages, setup


def _packages(root: str, prefix: str) -> list[str]:
    return [prefix] + [f"{prefix}.{name}" for name in find_packages(root)]


setup(
    packages=_packages("core", "llmserve") + _packages("plugins", "llmserve.plugins"),
    package_dir={"llmserve": "core", "llmserve.plugins": "plugins"},
    package_data={"llmserve": ["py.typed"], "llmserve.plugins": ["**/*.jinja", "**/*.c", "**/*.h",
                                                                 "**/*.html", "**/*.css", "**/*.js"]},
)
