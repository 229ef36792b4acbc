"""bufc: a declarative buffer compiler for LLM inference runtimes.

The distribution maps the repository's top-level folders onto subpackages:

* ``bufc.codegen``   (``codegen/``)   the compiler: buffers.yaml -> generated modules;
* ``bufc.runtime``   (``runtime/``)   the small torch library the generated modules call;
* ``bufc.rules``     (``rules/``)     the plain fill rules and checks they name;
* ``bufc.requests``  (``requests/``)  the requests' state and value checks (numpy, no torch);
* ``bufc.generated`` (``generated/``) one pregenerated module per model family;
* ``bufc.schema``    (``schema/``)    the JSON Schema of buffers.yaml.
"""

__version__ = "0.2.0"
