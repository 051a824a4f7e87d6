"""rpycdl: run Python functions on shared GPU servers over RPyC."""

from setuptools import find_packages, setup

setup(
    name="rpycdl",
    version="0.1.0",
    description="Run Python functions on shared GPU servers over RPyC, first come, first served",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["rpycdl", "rpycdl.*"]),
    package_data={"rpycdl": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=[
        "rpyc>=6.0,<7",
        "dill>=0.3.8",
        "fasteners>=0.19",
        "nvidia-ml-py>=12.535",
        "docker>=7.0",
        "cryptography>=41",
        "tomli>=1.1; python_version < '3.11'",
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6", "ruff>=0.5", "numpy>=1.22"],
        "bench": ["ray>=2.9"],  # bench/bench_core.py compares with Ray where it is installed
    },
    entry_points={"console_scripts": ["rpycdl=rpycdl.cli:main"]},
    classifiers=["Programming Language :: Python :: 3", "Operating System :: POSIX :: Linux"],
)
