/*
 * test_nccl_standin_nobind.c -- a library with every NCCL symbol that
 * comm/nccl_loader.c looks up but no raEmuNcclBind: what a real NCCL looks
 * like to an emulated build, which must refuse it.  Nothing here is called.
 */
#define NOT_NCCL(name) int name(void) { return 3; /* ncclInternalError */ }

NOT_NCCL(ncclGetVersion)
NOT_NCCL(ncclGetUniqueId)
NOT_NCCL(ncclCommInitRankConfig)
NOT_NCCL(ncclCommGetAsyncError)
NOT_NCCL(ncclCommAbort)
NOT_NCCL(ncclCommFinalize)
NOT_NCCL(ncclCommDestroy)
NOT_NCCL(ncclGroupStart)
NOT_NCCL(ncclGroupEnd)
NOT_NCCL(ncclSend)
NOT_NCCL(ncclRecv)
NOT_NCCL(ncclGetErrorString)
NOT_NCCL(ncclGetLastError)
