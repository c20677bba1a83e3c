from setuptools import find_packages, setup

setup(
    name="ampkit",
    version="0.1.0",
    description="Apex-style mixed-precision training (opt levels O0-O5) on modern PyTorch, any device.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ampkit", "ampkit.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.4,<3"],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6"],
        "bench": ["matplotlib>=3.5"],
        "fp8": ["torchao==0.18.0"],  # O6 / fp8=True; this release works with torch 2.13
    },
    entry_points={"console_scripts": ["ampkit=ampkit.cli:main"]},
)
