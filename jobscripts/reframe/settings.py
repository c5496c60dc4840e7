# ReFrame 4.x site configuration for running ndtrain's checks on the machine at hand: one
# system `local` (any host name), one partition `default` that starts jobs directly (the `local`
# scheduler) through `mpirun`, more ranks than cores allowed, and ReFrame's own `builtin`
# environment (whatever is on PATH: the checks build nothing). Everything ReFrame writes (stage and
# output folders, its log, the performance log, the run report) goes under
# $NDTRAIN_REFRAME_PREFIX, default out/reframe in the repository (ignored by git).
#
# A centre adds its own system beside `local`: see README.md in this folder.

import os

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
PREFIX = os.environ.get('NDTRAIN_REFRAME_PREFIX', os.path.join(_REPO, 'out', 'reframe'))
os.makedirs(PREFIX, exist_ok=True)

site_configuration = {
    'general': [
        {
            'report_file': os.path.join(PREFIX, 'reports', 'run-report-{sessionid}.json'),
        }
    ],
    'systems': [
        {
            'name': 'local',
            'descr': 'this machine: ranks started by mpirun, no batch scheduler',
            'hostnames': ['.*'],
            'modules_system': 'nomod',
            'prefix': PREFIX,
            'partitions': [
                {
                    'name': 'default',
                    'descr': 'mpirun on this host, oversubscribed',
                    'scheduler': 'local',
                    'launcher': 'mpirun',
                    'environs': ['builtin'],
                    'extras': {
                        # Appended to the launcher's command line by the checks.
                        'launcher_options': ['--oversubscribe'],
                        # Global tokens/s of the tiny deck on 2 ranks x 1 thread, measured on
                        # the 2-core development machine: 62 000-73 000 idle, 26 000 with the
                        # machine busy compiling. Generous bounds: a busy machine passes, a 10x
                        # regression (ranks serialised, an unoptimised build) does not.
                        'ndtrain_reference': {'tokens_per_s': [60000, -0.9, None, 'tokens/s']},
                    },
                    # Idle ranks yield the core instead of spinning (ranks may share cores).
                    'env_vars': [['OMPI_MCA_mpi_yield_when_idle', '1']],
                    'max_jobs': 1,
                }
            ],
        },
    ],
    'logging': [
        {
            'level': 'debug',
            'handlers': [
                {
                    'type': 'stream',
                    'name': 'stdout',
                    'level': 'info',
                    'format': '%(message)s',
                },
                {
                    'type': 'file',
                    'name': os.path.join(PREFIX, 'reframe.log'),
                    'level': 'debug',
                    'format': '[%(asctime)s] %(levelname)s: %(check_info)s: %(message)s',
                    'append': False,
                },
            ],
            'handlers_perflog': [
                {
                    'type': 'filelog',
                    'basedir': os.path.join(PREFIX, 'perflogs'),
                    'prefix': '%(check_system)s/%(check_partition)s',
                    'level': 'info',
                    'format': (
                        '%(check_job_completion_time)s|%(check_result)s|%(check_info)s|'
                        '%(check_perfvalues)s'
                    ),
                    'format_perfvars': (
                        '%(check_perf_var)s=%(check_perf_value)s %(check_perf_unit)s '
                        '(ref %(check_perf_ref)s, %(check_perf_lower_thres)s..'
                        '%(check_perf_upper_thres)s)|'
                    ),
                    'append': True,
                }
            ],
        }
    ],
}
