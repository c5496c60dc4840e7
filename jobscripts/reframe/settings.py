# ReFrame 4.x site configuration for ndtrain's checks. Systems are matched by host name, first
# match first: a centre's own systems come first, the catch-all `local` (this machine, any
# host name) last. The checks choose partitions and environments by features: a partition with
# `mpi` (and `gpu` for the GPU check), an environment with `ndtrain`.
#
# `example` shows a Slurm cluster as a centre would declare it (host names login*/nid*, which no
# machine here has): a CPU and a GPU partition launched with srun, the environment loading the
# `ndtrain` module, and the references of each check per partition. `local` starts jobs
# directly through mpirun, more ranks than cores allowed, and puts the binary's folder on PATH
# (NDTRAIN_BIN, relative to the repository root; else target/release, else target/debug).
#
# Everything ReFrame writes (stage and output folders, its log, the performance log, the run
# report) goes under $NDTRAIN_REFRAME_PREFIX, default out/reframe in the repository (ignored by
# git). Importing this file makes no folder: ReFrame makes its stage and output folders when it
# runs, and run.sh makes the prefix for ReFrame's log (make it first when running reframe
# yourself).

import os

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..'))
PREFIX = os.environ.get('NDTRAIN_REFRAME_PREFIX', os.path.join(_REPO, 'out', 'reframe'))


def _local_bin_dir():
    '''The folder of the ndtrain to test here: NDTRAIN_BIN's, else the release build's, else the
    debug build's (what `cargo test` builds).'''
    if os.environ.get('NDTRAIN_BIN'):
        return os.path.dirname(os.path.join(_REPO, os.environ['NDTRAIN_BIN']))
    for profile in ('release', 'debug'):
        folder = os.path.join(_REPO, 'target', profile)
        if os.path.exists(os.path.join(folder, 'ndtrain')):
            return folder
    return os.path.join(_REPO, 'target', 'release')


site_configuration = {
    'general': [
        {
            'report_file': os.path.join(PREFIX, 'reports', 'run-report-{sessionid}.json'),
        }
    ],
    'systems': [
        {
            'name': 'example',
            'descr': 'a Slurm cluster: CPU and GPU nodes, ndtrain from a module',
            'hostnames': [r'^login\d+', r'^nid\d+'],
            'modules_system': 'lmod',
            'prefix': PREFIX,
            'partitions': [
                {
                    'name': 'cpu',
                    'scheduler': 'slurm',
                    'launcher': 'srun',
                    'access': ['--partition=cpu'],
                    'features': ['mpi'],
                    'environs': ['ndtrain'],
                    'extras': {
                        # A site's own measurements (placeholders: measure, then state them).
                        'ndtrain_reference': {
                            'tiny': {'tokens_per_s': [200000, -0.5, None, 'tokens/s']},
                            'bench_small@1': {'tokens_per_s': [4000, -0.3, None, 'tokens/s']},
                            'bench_small@2': {'tokens_per_s': [7600, -0.3, None, 'tokens/s']},
                            'bench_small@4': {'tokens_per_s': [14000, -0.3, None, 'tokens/s']},
                        },
                    },
                },
                {
                    'name': 'gpu',
                    'scheduler': 'slurm',
                    'launcher': 'srun',
                    'access': ['--partition=gpu'],
                    'features': ['mpi', 'gpu'],
                    'environs': ['ndtrain'],
                    'extras': {
                        'ndtrain_reference': {
                            'gpu_1b': {'tokens_per_s': [100000, -0.2, None, 'tokens/s']},
                        },
                    },
                },
            ],
        },
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
                    'features': ['mpi'],
                    'environs': ['ndtrain-local'],
                    'extras': {
                        # Appended to the launcher's command line by the checks.
                        'launcher_options': ['--oversubscribe'],
                        # Global tokens/s on the 2-core development machine. tiny, 2 ranks x 1
                        # thread: 62 000-73 000 idle, 26 000 with the machine busy compiling.
                        # Generous bounds: a busy machine passes, a 10x regression (ranks
                        # serialised, an unoptimised build) does not.
                        'ndtrain_reference': {
                            'tiny': {'tokens_per_s': [60000, -0.9, None, 'tokens/s']},
                        },
                    },
                    # Idle ranks yield the core instead of spinning (ranks share cores here).
                    'env_vars': [['OMPI_MCA_mpi_yield_when_idle', '1']],
                    'max_jobs': 1,
                }
            ],
        },
    ],
    'environments': [
        {
            'name': 'ndtrain',
            'features': ['ndtrain'],
            'modules': ['ndtrain'],
            'target_systems': ['example'],
        },
        {
            'name': 'ndtrain-local',
            'features': ['ndtrain'],
            'env_vars': [['PATH', f'{_local_bin_dir()}:$PATH']],
            'target_systems': ['local'],
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
