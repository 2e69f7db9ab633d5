"""The sections of the report, one module each, listed once in `SECTIONS` in the
report's order.

A section module has:

- `NAME`: what `--only` calls it, its key in the JSON, and its template,
  `templates/<NAME>.md`;
- `DEFAULT`: whether it runs when `--only` is not given;
- `run(job)`: its figures, a dict that JSON can hold (but for compiled programs
  under the key `compiled`, which are dropped), given a `config.Job`;
- `render(figures, results)`: its markdown lines, given its figures (`None` when it
  was not measured) and the whole results.
"""

from . import (
    checker,
    exactness,
    lowp_memory,
    overhead,
    quantized_conv,
    quantized_dot,
    quantized_dot_general,
    qwix_mxfp8,
    ragged_dot,
    residuals,
    sr_step,
    suite,
    throughput,
    trace,
    trick,
    unbiased,
)

SECTIONS = (
    overhead,
    trick,
    residuals,
    trace,
    checker,
    suite,
    throughput,
    exactness,
    unbiased,
    quantized_dot,
    sr_step,
    quantized_conv,
    quantized_dot_general,
    ragged_dot,
    qwix_mxfp8,
    lowp_memory,
)
