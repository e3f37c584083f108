"""Generates mhc_client._pb from proto/ while building (see build_stubs.py).

The generated modules are build outputs, never committed: building a wheel
runs protoc and grpc_python_plugin on the checkout's protos.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithStubs(build_py):
    def run(self) -> None:
        import build_stubs

        build_stubs.generate(Path(__file__).resolve().parent)
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
